"""Train a GPT with Megatron-LM's flags: `python train.py --help`.

With no flags it trains the embedded default (a small GPT on the built-in corpus); without an accelerator it runs on
8 simulated CPU devices with tensor and data parallelism.
"""

import os
import sys

from mtx.devices import simulate_cpu_devices

simulate_cpu_devices(8)  # without an accelerator; a GPU host still lists its GPUs


def main(argv=None) -> int:
    from mtx.cli import parse_config
    from mtx.distributed import initialize

    try:  # bad input fails here, in one line that names the fix, before any device work
        cfg = parse_config(argv)
        p = cfg.parallel
        # Multi-host: join the other processes before anything asks JAX for a device.
        initialize(p.coordinator_address, p.num_processes, p.process_id, heartbeat_timeout=p.distributed_timeout)
        from mtx.run import prepare, train

        plan = prepare(cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import jax

    from mtx.checkpoint import CheckpointError
    from mtx.distributed import lost_peer

    try:
        train(plan)
    except CheckpointError as e:  # damage to a checkpoint that only reading its arrays finds
        print(f"error: {e}", file=sys.stderr)
        return 2
    except jax.errors.JaxRuntimeError as e:
        if (message := lost_peer(e, cfg.training.save)) is None:
            raise
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)  # not sys.exit: its shutdown would wait at a barrier for the process that is gone
    return 0


if __name__ == "__main__":
    sys.exit(main())
