"""The model section of the config schema (`ModelConfig`): the transformer's shape, its blocks, and the arithmetic
that follows from them (padded vocabulary, parameter count, training FLOPs per token).

GPT-2's blocks are the defaults: learned absolute positions, LayerNorm, a GeLU MLP, multi-head attention, biases on
every linear, the output layer tied to the input embedding. Megatron-Core's flags switch each to Llama's: rotary
positions (`--position-embedding-type rope`, `--rotary-base`, `--rotary-percent`, Llama 3.1's frequency scaling
`--use-rope-scaling`), `--normalization RMSNorm`, `--swiglu`, grouped-query attention (`--group-query-attention
--num-query-groups G`), `--disable-bias-linear` and `--untie-embeddings-and-output-weights`. Their combinations
are checked with the rest of the config (mtx/schema_checks.py, mtx/config_checks.py); how each runs under tensor
parallelism is in docs/design.md ("Llama's blocks").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mtx.schema_checks import described as _f

# Fields added after checkpoints were first written: a saved config without them loads with their defaults, which
# are the blocks those checkpoints were trained with (mtx/checkpoint.py does not count them as missing).
ADDED_FIELDS = frozenset({"position_embedding_type", "rotary_base", "rotary_percent", "normalization",
                          "norm_epsilon", "swiglu", "group_query_attention", "num_query_groups",
                          "untie_embeddings_and_output_weights", "disable_bias_linear", "use_rope_scaling",
                          "rope_scaling_factor", "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor",
                          "rope_scaling_original_max_position_embeddings", "bias_gelu_fusion", "bias_swiglu_fusion",
                          "gemm_epilogues"})
# Fields that choose how a step computes, not what the parameters are: a checkpoint resumes with either value, and
# --use-checkpoint-args leaves them to this run.
COMPUTE_ONLY = ("bias_gelu_fusion", "bias_swiglu_fusion", "gemm_epilogues")
# Fields that shape no parameter: regularization, init, and how a step computes (checkpoint compatibility and
# --use-checkpoint-args leave them out, each with one more of its own: the sequence length, the vocabulary).
NOT_SHAPING = ("hidden_dropout", "attention_dropout", "label_smoothing", "init_method_std", *COMPUTE_ONLY)


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int = _f(4, "transformer layers L")
    hidden_size: int = _f(128, "model width D")
    num_attention_heads: int = _f(8, "heads N; head dim H = D / N")
    ffn_hidden_size: int | None = _f(None, "MLP width F; None means 4 * hidden_size (with --swiglu, 8 / 3 of it "
                                           "rounded down to a multiple of 64, as Megatron)")
    seq_length: int = _f(128, "tokens per training sequence S")
    max_position_embeddings: int | None = _f(None, "rows of the learned position table (with rope: the longest "
                                                   "sequence generation runs); None means seq_length")
    vocab_size: int = _f(50257, "tokenizer vocabulary before padding (set from the tokenizer when data is loaded), "
                                "but with NullTokenizer its size: ids 0 .. N - 1, end-of-document N (Megatron's)")
    make_vocab_size_divisible_by: int = _f(128, "each model-parallel vocab shard is a multiple of this")
    hidden_dropout: float = _f(0.1, "dropout on the residual branches and embeddings (one mask per sequence, any mesh)")
    attention_dropout: float = _f(0.1, "dropout on attention probabilities (masks by sequence and head: any mesh's)")
    init_method_std: float = _f(0.02, "std of N(0, std) init; residual projections use std / sqrt(2 L)")
    layernorm_epsilon: float = _f(1e-5, "LayerNorm epsilon")
    label_smoothing: float = _f(0.0, "label smoothing of the vocab-parallel cross-entropy")
    model_type: str = _f("gpt", "gpt (causal LM) | bert (masked LM + sentence-order prediction, bidirectional)")
    layernorm_placement: str = _f("pre", "pre: x + f(LN(x)) and a final LN (paper); post: LN(x + f(x)) (original BERT)")
    num_tokentypes: int = _f(2, "BERT's token-type (segment A/B) embeddings; 0: none; GPT has none")
    bert_binary_head: bool = _f(True, "BERT's sentence-order-prediction head on [CLS]")
    position_embedding_type: str = _f("learned_absolute", "learned_absolute (a learned table added to the "
                                                          "embeddings, GPT-2) | rope (rotary, applied to q and k)")
    rotary_base: float = _f(10000.0, "rope: base of the rotary frequencies (Llama 3: 500000)")
    rotary_percent: float = _f(1.0, "rope: fraction of each head's dimensions that rotate (the first ones)")
    use_rope_scaling: bool = _f(False, "rope: Llama 3.1's frequency scaling for long contexts (HF rope_type llama3)")
    rope_scaling_factor: float = _f(8.0, "--use-rope-scaling: how much the low frequencies are stretched (Llama 3.1: "
                                         "8, Llama 3.2: 32)")
    rope_scaling_low_freq_factor: float = _f(1.0, "--use-rope-scaling: wavelengths above the original context / this "
                                                  "are stretched by the whole factor")
    rope_scaling_high_freq_factor: float = _f(4.0, "--use-rope-scaling: wavelengths below the original context / "
                                                   "this are kept (between the two: interpolated)")
    rope_scaling_original_max_position_embeddings: int = _f(8192, "--use-rope-scaling: the context the model was "
                                                                  "first trained at")
    normalization: str = _f("LayerNorm", "LayerNorm | RMSNorm (scale only, no mean subtraction)")
    norm_epsilon: float | None = _f(None, "epsilon of LayerNorm or RMSNorm (Megatron-Core's name of "
                                          "--layernorm-epsilon); None: --layernorm-epsilon")
    swiglu: bool = _f(False, "SwiGLU MLP: silu(x W_gate) * (x W_up), then W_down (GeLU MLP without)")
    group_query_attention: bool = _f(False, "grouped-query attention: --num-query-groups key/value heads shared by "
                                            "the query heads")
    num_query_groups: int | None = _f(None, "key/value groups G with --group-query-attention (it must divide the "
                                            "heads); None: 1 (multi-query attention, Megatron's default)")
    untie_embeddings_and_output_weights: bool = _f(False, "an output layer of its own instead of the input "
                                                          "embedding's transpose")
    disable_bias_linear: bool = _f(False, "no bias in the attention and MLP linears")
    bias_gelu_fusion: bool = _f(False, "the MLP's bias add and GeLU as one function whose backward recomputes the "
                                       "GeLU from the matmul's output: one (tokens, F) activation less kept a layer "
                                       "(7.5 GiB at 1.2B, micro batch 16), ~1% slower on an H200; off: autodiff's")
    bias_swiglu_fusion: bool = _f(False, "--swiglu: silu(gate) * up as one function whose backward recomputes it "
                                         "from the two matmuls' outputs, keeping nothing else (the Llama 1B preset: "
                                         "the same memory, within 1% of the speed on an H200); off: autodiff's")
    gemm_epilogues: bool = _f(False, "the GeLU MLP's bias + GeLU inside its first matmul, the GeLU's derivative "
                                     "inside the second's input-gradient matmul and the q, k, v biases inside their "
                                     "matmuls (cuBLASLt epilogues on NVIDIA GPUs in bf16; elsewhere the same functions "
                                     "through XLA): the 1.2B step 4.2% faster on an H100, 1.9% on an H200, with 2.5-11 "
                                     "GiB less memory, GPT-2 355M's 3.5% (H100); on in those presets; off: XLA's "
                                     "separate passes")

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.swiglu:  # two input matrices: 2 / 3 of the width keeps the MLP's parameters (Megatron's rule)
            return int(4 * self.hidden_size * 2 / 3 / 64) * 64
        return 4 * self.hidden_size

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    @property
    def is_bert(self) -> bool:
        return self.model_type == "bert"

    @property
    def has_dropout(self) -> bool:
        return self.hidden_dropout > 0 or self.attention_dropout > 0

    def acts(self, name: str) -> bool:
        """Whether the field `name` changes this model: a setting of a feature that is off (--rotary-base without
        rope, --num-query-groups without grouped-query attention, ...) does not."""
        gated = {"rotary_base": self.rope, "rotary_percent": self.rope, "use_rope_scaling": self.rope,
                 "num_query_groups": self.group_query_attention, "num_tokentypes": self.is_bert,
                 "layernorm_placement": self.is_bert}
        if name.startswith("rope_scaling_"):
            return self.rope_scaling is not None
        return gated.get(name, True)

    @property
    def tokentypes(self) -> int:
        """Rows of the token-type table: num_tokentypes for BERT, none for GPT."""
        return self.num_tokentypes if self.is_bert else 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """G, the key/value heads: --num-query-groups (1 if not given) with --group-query-attention, else one per
        query head."""
        if not self.group_query_attention:
            return self.num_attention_heads
        return self.num_query_groups or 1

    @property
    def rope(self) -> bool:
        return self.position_embedding_type == "rope"

    @property
    def rope_scaling(self) -> tuple[float, float, float, int] | None:
        """(factor, low_freq_factor, high_freq_factor, original max positions) with --use-rope-scaling (and rotary
        positions), else None."""
        if not (self.rope and self.use_rope_scaling):
            return None
        return (self.rope_scaling_factor, self.rope_scaling_low_freq_factor, self.rope_scaling_high_freq_factor,
                self.rope_scaling_original_max_position_embeddings)

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that rotate: the first int(H x --rotary-percent) (Megatron's rounding)."""
        return int(self.head_dim * self.rotary_percent)

    @property
    def epsilon(self) -> float:
        """The normalization's epsilon: --norm-epsilon, else --layernorm-epsilon."""
        return self.layernorm_epsilon if self.norm_epsilon is None else self.norm_epsilon

    @property
    def tied(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    def llama_blocks(self) -> list[str]:
        """The flags of the blocks that differ from GPT-2's ([] for GPT-2's model)."""
        on = {"--position-embedding-type rope": self.rope, "--normalization RMSNorm": self.normalization == "RMSNorm",
              "--swiglu": self.swiglu, "--group-query-attention": self.group_query_attention,
              "--untie-embeddings-and-output-weights": not self.tied, "--disable-bias-linear": self.disable_bias_linear}
        return [flag for flag, set_ in on.items() if set_]

    @property
    def padded_vocab_size(self) -> int:
        """Vocabulary padded so every shard of TP 1, 2, 4 or 8 is a multiple of 128 (50,257 -> 51,200).

        Megatron pads to a multiple of 128 x TP, which makes the embedding's shape depend on the mesh; padding for
        TP = 8 once gives every mesh the same parameter shapes (so the same seed gives the same weights on any mesh
        and checkpoints load onto any mesh) at the paper's own padded size.
        """
        multiple = self.make_vocab_size_divisible_by * 8
        return math.ceil(self.vocab_size / multiple) * multiple

    def num_params(self) -> int:
        """Parameters, the vocabulary padded (GPT-2 124M: 124,439,808 unpadded; the paper's BERT 336M: 336,429,058
        with its vocabulary padded to 30,720); a tied output layer is the input embedding, counted once."""
        return _num_params(self, self.padded_vocab_size)

    def num_params_unpadded(self) -> int:
        """Parameters with the tokenizer's vocabulary, as Hugging Face counts them (Llama-3.2-1B: 1,235,814,400)."""
        return _num_params(self, self.vocab_size)

    def flops_per_token(self, mlm_positions: int | None = None) -> float:
        """Training FLOPs per token: 6N (forward + backward of every weight) + 12 L D S (attention scores and
        context, forward and backward, N H = D wide whatever the key/value groups); N counts the tied embedding
        once, as it is used for the logits, and leaves out an untied input embedding (a lookup, no matmul).

        mlm_positions: BERT's masked-LM head runs at that many positions of each sequence (`Config.mlm_positions`),
        not all S: its dense layer and logits count at that share of the tokens."""
        lookup = 0 if self.tied else self.padded_vocab_size * self.hidden_size
        flops = 6 * (self.num_params() - lookup) + 12 * self.num_layers * self.hidden_size * self.seq_length
        if self.is_bert and mlm_positions is not None:
            head = self.hidden_size * (self.hidden_size + self.padded_vocab_size)  # dense D -> D, tied logits
            flops -= 6 * head * (1 - mlm_positions / self.seq_length)
        return flops


def _num_params(m: ModelConfig, vocab: int) -> int:
    d, f, kv = m.hidden_size, m.ffn_size, m.query_groups * m.head_dim
    bias = 0 if m.disable_bias_linear else 1
    norm = d if m.normalization == "RMSNorm" else 2 * d  # scale (and bias)
    gates = 2 if m.swiglu else 1  # SwiGLU's gate and up matrices
    attention = d * (d + 2 * kv) + bias * (d + 2 * kv) + d * d + bias * d  # q, k, v (G groups), out
    mlp = gates * (d * f + bias * f) + f * d + bias * d  # fc1 (gate and up), fc2
    layer = attention + mlp + 2 * norm
    positions = 0 if m.rope else m.max_positions * d
    output = 0 if m.tied else vocab * d
    total = vocab * d + positions + m.num_layers * layer + norm + output  # + final norm (BERT post-LN: embedding LN)
    if m.is_bert:
        total += m.tokentypes * d  # token-type embeddings
        total += (d * d + d) + 2 * d + vocab  # MLM head: dense D -> D, LayerNorm, output bias (logits tied)
        if m.bert_binary_head:
            total += (d * d + d) + (d * 2 + 2)  # pooler dense D -> D, sentence-order classifier D -> 2
    return total
