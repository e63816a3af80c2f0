"""Train a GPT with Megatron-LM's flags: `python train.py --help`.

With no flags it trains the embedded default (a small GPT on the built-in corpus); without an accelerator it runs on
8 simulated CPU devices with tensor and data parallelism.
"""

import os
import sys

from mtx.errors import script_needs

script_needs("jax", "pip install -e . here first; '.[cuda12]' for NVIDIA GPUs", __name__)  # (else a traceback)

from mtx.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)  # without an accelerator; a GPU host still lists its GPUs


def main(argv=None) -> int:
    from mtx.cli import parse_config
    from mtx.devices import use_memory_fraction
    from mtx.distributed import initialize_from, watch_peers

    try:  # bad input fails here, in one line that names the fix, before any device work
        cfg = parse_config(argv)
        use_memory_fraction(cfg.training.gpu_memory_fraction)  # before JAX starts its backends (joining starts them)
        # Multi-host: join the other processes before anything asks JAX for a device.
        initialize_from(cfg.parallel)
        from mtx.run import prepare, train

        plan = prepare(cfg)  # its first device query refuses a backend JAX cannot start in one line
    except ValueError as e:  # every process finds the same bad input
        if peers := watch_peers():
            peers.finish()
        print(f"error: {e}", file=sys.stderr)
        return 2
    import jax

    from mtx.checkpoint import CheckpointError
    from mtx.distributed import is_main_process, lost_peer
    from mtx.errors import out_of_memory, training_memory_fixes
    from mtx.files import run_files
    from mtx.metrics import TrackerError
    from mtx.run_lock import InUse

    if is_main_process():
        print(run_files(plan.cfg, plan.run_dir), flush=True)
    peers = watch_peers(cfg.training.save)  # several processes: a peer that stops answering ends this one in a line
    try:
        train(plan)
    except CheckpointError as e:  # damage to a checkpoint that only reading its arrays finds (every process reads it)
        if peers:
            peers.finish()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (TrackerError, InUse) as e:  # W&B would not start; a run that took the run directory first, after both
        print(f"error: {e}", file=sys.stderr)  # checked it (process 0; the others then find it gone)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C (the first one finishes the step and saves), or one before the loop
        print("error: interrupted (SIGINT) before the run could save; the checkpoints it finished (with --save) are "
              "intact, and --load resumes from the newest.", file=sys.stderr)
        return 130
    except jax.errors.JaxRuntimeError as e:
        if (message := out_of_memory(e, training_memory_fixes(plan.cfg))) is not None and jax.process_count() == 1:
            print(f"error: {message}", file=sys.stderr)  # (the run's own files, its lock, were let go on the way)
            return 1
        if (message := message or lost_peer(e, cfg.training.save)) is None:
            raise
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)  # not sys.exit: its shutdown would wait at a barrier for the process that is gone
    if peers:
        peers.finish()
    if is_main_process():  # again at the end (also after a stop on a signal), where it is read
        print(run_files(plan.cfg, plan.run_dir))
    return 0


if __name__ == "__main__":
    from mtx.errors import exit_with

    exit_with(main)
