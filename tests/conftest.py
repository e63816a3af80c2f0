"""Every test sees 8 simulated CPU devices; this must run before JAX starts its backends anywhere."""

import os

from mtx.devices import simulate_cpu_devices

simulate_cpu_devices(8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The tests' programs are tiny and compiled hundreds of times: XLA's CPU backend without LLVM's optimizations compiles
# them sooner (the suite on 2 cores: 17 min 54 s against 23 min 41 s); the runs compared are all compiled alike, and
# a level the caller sets wins.
if os.environ["JAX_PLATFORMS"] == "cpu" and "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
# One persistent compilation cache for this test run (its xdist workers and the train.py processes tests start):
# the many runs of the same tiny programs compile once. Tests of the cache itself set their own directory.
# Made by the process that starts the run (xdist's workers inherit it) and removed when that process ends the run.
# An entry cut short by a process a test kills is read as a miss (JAX warns and compiles again).
OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    OWN_CACHE = tempfile.mkdtemp(prefix="mtx-tests-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = OWN_CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

import jax  # noqa: E402
import pytest  # noqa: E402

from mtx.data.paths import shared_data_dir  # noqa: E402


def pytest_configure(config):
    assert len(jax.devices()) >= 8, "tests need 8 simulated devices; XLA_FLAGS was set too late"


def pytest_unconfigure(config):
    if OWN_CACHE is not None:
        import shutil

        shutil.rmtree(OWN_CACHE, ignore_errors=True)


@pytest.fixture
def shared_data():
    """The reference data folder ($MTX_DATA_DIR or its default place); tests that need it skip where it is absent."""
    path = shared_data_dir()
    if path is None:
        pytest.skip("reference data not found: set MTX_DATA_DIR to the folder holding gpt2/, wikitext-2/, ...")
    return path


@pytest.fixture(scope="session")
def bert_toy(tmp_path_factory):
    """A small WordPiece vocab.txt built from the first 40 kB of the built-in corpus, and that text: BERT training
    tests without the 30,522-entry vocabulary (a 1,024-row embedding keeps them fast). Returns (vocab, corpus)."""
    import collections
    import re

    from mtx.data.dataset import builtin_corpus

    text = builtin_corpus()[:40_000]
    words = collections.Counter(re.findall(r"[a-z]+", text.lower()))
    chars = sorted(set("abcdefghijklmnopqrstuvwxyz0123456789") | set("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"))
    pieces = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *("##" + c for c in chars),
              "##s", "##ed", "##ing", "##er", "##ly", "##tion"]
    pieces += [w for w, _ in words.most_common(600) if len(w) > 1]
    folder = tmp_path_factory.mktemp("bert_toy")
    (folder / "vocab.txt").write_text("\n".join(dict.fromkeys(pieces)) + "\n")
    (folder / "corpus.txt").write_text(text)
    return folder / "vocab.txt", folder / "corpus.txt"


@pytest.fixture
def refused(capsys):
    """Runs `python -m mtx.data.preprocess` on bad input: asserts exit status 2 and one error line on stderr (tqdm's
    bar aside) and returns that line."""
    from mtx.data.preprocess import main as preprocess

    def run(argv) -> str:
        with pytest.raises(SystemExit) as e:
            preprocess(argv)
        errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert e.value.code == 2 and len(errors) == 1, errors
        return errors[0].strip()

    return run


@pytest.fixture
def shared_initial_state(monkeypatch):
    """`TrainStep.init_state` (so also `mtx.run.train`) built once per state shape and placed on each later mesh:
    the initial state does not depend on the mesh (tests/test_training.py), and building it costs as much as a
    step's compile on CPU. For tests that compare one config's losses across meshes."""
    from mtx.state import state_shardings
    from mtx.step import TrainStep

    built, own = {}, TrainStep.init_state

    def init_state(self):
        abstract = self.abstract_state()
        key = str(jax.tree.structure(abstract)), tuple((x.shape, x.dtype) for x in jax.tree.leaves(abstract))
        if key not in built:
            built[key] = jax.device_get(own(self))
        return jax.device_put(built[key], state_shardings(self.model))

    monkeypatch.setattr(TrainStep, "init_state", init_state)
