"""Llama 3.1 / 3.2's rope frequency scaling (--use-rope-scaling, HF's rope_type llama3): the frequencies are HF's
formula, a converted scaled Llama computes transformers' logits and exports back to the same config, what mtx lacks
is refused in one line, and the mesh still changes nothing (the scaling acts on positions only)."""

import numpy as np
import pytest
from helpers import loss_and_grads
from test_convert_llama import S_MAX, VOCAB, hf_config, mtx_logits, random_hf_tensors, refused, token_ids, write_hf
from test_llama import LLAMA, TINY

from mtx.cli import parse_config
from mtx.convert import main, read_hf
from mtx.convert_llama import config_from_hf, config_to_hf
from mtx.loading import load_model
from mtx.models.rotary import inverse_frequencies

# Small enough for 32-token sequences to pass the original context: with head dim 16 and base 5000, wavelengths
# 6.3 (kept: < 16 / 2), 18.2 (interpolated) and 53 .. 11,000 (stretched: > 16 / 0.5).
SCALED = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 0.5, "high_freq_factor": 2.0,
          "original_max_position_embeddings": 16}


def hf_llama3_inv_freq(dim, base, factor, low, high, original):
    """HF's _compute_llama3_parameters, written again in float64 NumPy: each frequency kept, divided by the factor,
    or (between the two wavelengths) the interpolation of the two."""
    out = []
    for f in base ** (-np.arange(0, dim, 2) / dim):
        wavelength = 2 * np.pi / f
        if wavelength < original / high:
            out.append(f)
        elif wavelength > original / low:
            out.append(f / factor)
        else:
            t = (original / wavelength - low) / (high - low)
            out.append((1 - t) * f / factor + t * f)
    return np.array(out)


@pytest.mark.parametrize("dim,base,scaling", [(64, 500000.0, (32.0, 1.0, 4.0, 8192)),  # Llama-3.2-1B
                                              (128, 500000.0, (8.0, 1.0, 4.0, 8192)),  # Llama-3.1-8B
                                              (16, 5000.0, (4.0, 0.5, 2.0, 16))])  # the tiny test model's
def test_scaled_frequencies_are_hugging_faces(dim, base, scaling):
    want, plain = hf_llama3_inv_freq(dim, base, *scaling), base ** (-np.arange(0, dim, 2) / dim)
    kept, stretched = want == plain, np.isclose(want, plain / scaling[0])
    assert kept.any() and stretched.any() and not (kept | stretched).all()  # every regime is exercised
    np.testing.assert_allclose(np.asarray(inverse_frequencies(dim, base, scaling)), want, rtol=2e-6)
    np.testing.assert_allclose(np.asarray(inverse_frequencies(dim, base)), plain, rtol=2e-6)


def test_config_maps_both_ways():
    """NumPy only: rope_scaling (transformers 4) or rope_parameters (transformers 5) -> the fields -> rope_scaling."""
    m = config_from_hf(hf_config(rope_scaling=SCALED)).model
    assert m.rope_scaling == (4.0, 0.5, 2.0, 16) and m.use_rope_scaling
    assert config_to_hf(m)["rope_scaling"] == SCALED and config_from_hf(config_to_hf(m)).model == m
    v5 = {k: v for k, v in hf_config().items() if k not in ("rope_theta", "rope_scaling")}
    assert config_from_hf(v5 | {"rope_parameters": SCALED | {"rope_theta": 5000.0}}).model == m
    assert config_to_hf(config_from_hf(hf_config()).model)["rope_scaling"] is None
    flags = parse_config(["--position-embedding-type", "rope", "--use-rope-scaling", "--rope-scaling-factor", "32"])
    assert flags.validate().model.rope_scaling == (32.0, 1.0, 4.0, 8192)  # Megatron-Core's defaults


@pytest.mark.parametrize("rope,needle", [
    ({"rope_type": "linear", "factor": 2.0}, "config.json has rope_scaling of rope_type 'linear'"),
    ({"type": "dynamic", "factor": 2.0}, "config.json has rope_scaling of rope_type 'dynamic'"),
    ({k: v for k, v in SCALED.items() if k != "high_freq_factor"}, "rope_scaling of rope_type 'llama3' lacks "
                                                                  "high_freq_factor"),
    (SCALED | {"factor": 0.5}, "config.json: rope_scaling factor must be >= 1, got 0.5"),
])
def test_scalings_mtx_lacks_are_refused_in_one_line(tmp_path, capsys, rope, needle):
    write_hf(tmp_path / "hf", hf_config(rope_scaling=rope), random_hf_tensors(hf_config()))
    assert needle in refused(capsys, ["from-hf", "--hf-dir", str(tmp_path / "hf"), "--save", str(tmp_path / "c")])


@pytest.mark.parametrize("flags,needle", [
    (dict(position_embedding_type="rope", use_rope_scaling=True, rope_scaling_high_freq_factor=1.0),
     "--rope-scaling-high-freq-factor 1.0 must be above --rope-scaling-low-freq-factor 1.0"),
    (dict(rope_scaling_original_max_position_embeddings=0), "--rope-scaling-original-max-position-embeddings must "
                                                            "be >= 1"),
])
def test_bad_scaling_flags_are_refused_in_one_line(flags, needle):
    with pytest.raises(ValueError, match="^" + needle.replace(".", r"\.")) as e:
        TINY.replace(**flags).validate(8)
    assert "\n" not in str(e.value)


def test_losses_with_scaling_are_the_same_on_two_meshes():
    """Scaled frequencies (rotary dims 6: one kept, two stretched) change the gradients but not their mesh
    invariance."""
    cfg = TINY.replace(**LLAMA, use_rope_scaling=True, rope_scaling_factor=4.0,
                       rope_scaling_original_max_position_embeddings=16, global_batch_size=8, micro_batch_size=4)
    loss, grads = loss_and_grads(cfg, 1, 1, 1)
    other, other_grads = loss_and_grads(cfg, 2, 1, 4, sequence_parallel=True)
    assert other == pytest.approx(loss, rel=1e-6)
    name = "['layers']['attention']['query']['kernel']"
    np.testing.assert_allclose(other_grads[name], grads[name], rtol=1e-5, atol=1e-5 * np.abs(grads[name]).max())
    _, unscaled = loss_and_grads(cfg, 1, 1, 1, use_rope_scaling=False)  # the loss barely moves at init
    assert np.abs(unscaled[name] - grads[name]).max() > 1e-2 * np.abs(grads[name]).max()


def test_matches_transformers(tmp_path):
    """The real LlamaForCausalLM with llama3 scaling at 32 positions (twice its original 16): mtx's logits on TP 1
    and 2 within 1e-4 (the unscaled model's are far off), and the export reloads with the same logits."""
    torch = pytest.importorskip("torch", reason="torch not installed (pip install torch transformers to run this)")
    transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install transformers)")
    ids = token_ids(s=S_MAX)
    torch.manual_seed(0)
    hf = hf_config(rope_scaling=dict(SCALED))  # transformers adds rope_theta to it
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf)).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "hf")

    def torch_logits(m):
        with torch.no_grad():
            return m(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()

    expected = torch_logits(model)
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config())).float().eval()
    plain.load_state_dict(model.state_dict())
    assert np.abs(torch_logits(plain) - expected).max() > 1e-2  # the scaling matters at these positions
    assert main(["from-hf", "--hf-dir", str(tmp_path / "hf"), "--save", str(tmp_path / "c")]) == 0
    for tp in (1, 2):
        mtx_model, params = load_model(str(tmp_path / "c"), tensor_model_parallel_size=tp)
        assert mtx_model.cfg.model.rope_scaling == (4.0, 0.5, 2.0, 16)
        diff = np.abs(mtx_logits(mtx_model, params, ids)[..., :VOCAB] - expected)
        print(f"llama3 scaling TP {tp}: max |mtx - transformers| = {diff.max():.2e}")
        np.testing.assert_array_less(diff, 1e-4)
    assert main(["to-hf", "--load", str(tmp_path / "c"), "--hf-dir", str(tmp_path / "back")]) == 0
    assert read_hf(tmp_path / "back")[0]["rope_scaling"] == SCALED
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back").float().eval()
    np.testing.assert_array_equal(torch_logits(reloaded), expected)
