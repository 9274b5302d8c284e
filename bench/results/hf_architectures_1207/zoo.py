"""Hugging Face architectures at ZeRO stage 3 against one process (world 2, simulated ranks), 2026-12-07.

    PYTHONPATH=<repo> OMP_NUM_THREADS=1 python zoo.py bert roberta distilbert t5 bart qwen2 gemma mistral opt \
        bloom neox phi falcon vit gpt_bigcode mixtral qwen3moe clip whisper   # 3 SGD steps: loss and param error
    PYTHONPATH=<repo> OMP_NUM_THREADS=1 python zoo.py gen t5 bart whisper qwen2 mixtral   # generate() after steps

Each model is a tiny one built from its config (transformers 5.24), dropout masks seeded alike in both runs. The
output of both commands is output.txt; a generate line gives the model, the beams, whether gradient checkpointing
is on, [greedy tokens equal to one process's after step 1, after step 2] and the last loss difference.
from_pretrained of T5, Whisper and BERT is a test (tests/test_hf.py).
"""
import copy
import sys

import torch
import torch.nn as nn
import transformers as T

import zero_engine
from zero_engine.testing import run_ranks
from zero_engine.utils import safe_get_full_fp32_param

V = 96
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
S2S = dict(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
           decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64)
BUILD = {
    "bert": lambda: (T.BertForMaskedLM(T.BertConfig(vocab_size=V, **SMALL, max_position_embeddings=64)), "mlm"),
    "roberta": lambda: (T.RobertaForMaskedLM(T.RobertaConfig(vocab_size=V, **SMALL, max_position_embeddings=70)),
                        "mlm"),
    "distilbert": lambda: (T.DistilBertForMaskedLM(T.DistilBertConfig(
        vocab_size=V, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=64)), "mlm"),
    "t5": lambda: (T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0)), "s2s"),
    "bart": lambda: (T.BartForConditionalGeneration(T.BartConfig(**S2S, max_position_embeddings=64)), "s2s"),
    "qwen2": lambda: (T.Qwen2ForCausalLM(T.Qwen2Config(vocab_size=V, **SMALL, num_key_value_heads=2)), "clm"),
    "gemma": lambda: (T.GemmaForCausalLM(T.GemmaConfig(vocab_size=V, **SMALL, num_key_value_heads=2, head_dim=8)),
                      "clm"),
    "mistral": lambda: (T.MistralForCausalLM(T.MistralConfig(vocab_size=V, **SMALL, num_key_value_heads=2)), "clm"),
    "opt": lambda: (T.OPTForCausalLM(T.OPTConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64, word_embed_proj_dim=32,
        max_position_embeddings=64)), "clm"),
    "bloom": lambda: (T.BloomForCausalLM(T.BloomConfig(vocab_size=V, hidden_size=32, n_layer=2, n_head=4)), "clm"),
    "neox": lambda: (T.GPTNeoXForCausalLM(T.GPTNeoXConfig(vocab_size=V, **SMALL, max_position_embeddings=64)), "clm"),
    "phi": lambda: (T.PhiForCausalLM(T.PhiConfig(vocab_size=V, **SMALL, max_position_embeddings=64)), "clm"),
    "falcon": lambda: (T.FalconForCausalLM(T.FalconConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)), "clm"),
    "vit": lambda: (T.ViTForImageClassification(T.ViTConfig(**SMALL, image_size=16, patch_size=4, num_labels=5)),
                    "img"),
    "gpt_bigcode": lambda: (T.GPTBigCodeForCausalLM(T.GPTBigCodeConfig(
        vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64)), "clm"),
    "mixtral": lambda: (T.MixtralForCausalLM(T.MixtralConfig(
        vocab_size=V, **SMALL, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)), "clm"),
    "qwen3moe": lambda: (T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(
        vocab_size=V, **SMALL, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        head_dim=8)), "clm"),
    "clip": lambda: (T.CLIPModel(T.CLIPConfig(
        text_config=dict(vocab_size=V, **SMALL, max_position_embeddings=32),
        vision_config=dict(**SMALL, image_size=16, patch_size=4), projection_dim=16)), "clip"),
    "whisper": lambda: (T.WhisperForConditionalGeneration(T.WhisperConfig(
        **S2S, num_mel_bins=8, max_source_positions=16, max_target_positions=32, decoder_start_token_id=1,
        pad_token_id=0)), "audio"),
}


def build(name):
    torch.manual_seed(0)
    return BUILD[name]()


def batch(kind, g):
    ids = lambda n: torch.randint(3, V, (2, n), generator=g)  # noqa: E731
    if kind == "mlm":
        x = ids(12)
        labels = torch.full_like(x, -100)
        labels[:, ::3] = x[:, ::3]
        return dict(input_ids=x, labels=labels)
    if kind == "s2s":
        return dict(input_ids=ids(10), labels=ids(7))
    if kind == "clm":
        x = ids(12)
        return dict(input_ids=x, labels=x)
    if kind == "img":
        return dict(pixel_values=torch.randn(2, 3, 16, 16, generator=g), labels=torch.randint(0, 5, (2,), generator=g))
    if kind == "clip":
        return dict(input_ids=ids(8), pixel_values=torch.randn(2, 3, 16, 16, generator=g), return_loss=True)
    return dict(input_features=torch.randn(2, 8, 32, generator=g), labels=ids(6))


def config(stage):
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                  "stage3_max_reuse_distance": 0}}


def full_values(model):
    """fp32 masters, or the gathered value of a frozen parameter (which has none)."""
    full = [safe_get_full_fp32_param(p) for p in model.parameters()]
    with zero_engine.zero.GatheredParameters(list(model.parameters())):
        return [f if f is not None else p.detach().float().clone() for f, p in zip(full, model.parameters())]


def step_both(ref, opt, engine, b, seed):
    """One SGD step of the one-process reference and of the engine on batch ``b``, dropout masks seeded alike."""
    torch.manual_seed(seed)
    opt.zero_grad()
    expected = ref(**b).loss
    expected.backward()
    opt.step()
    torch.manual_seed(seed)
    loss = engine(**b).loss
    engine.backward(loss)
    engine.step()
    return loss, expected


def train_body(name, stage):
    model, kind = build(name)
    model.train()
    ref = copy.deepcopy(model)
    try:
        engine, *_ = zero_engine.initialize(model=model, config=config(stage))
        opt = torch.optim.SGD(ref.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(1)
        losses = []
        for i in range(3):
            b = batch(kind, g)
            loss, expected = step_both(ref, opt, engine, b, seed=100 + i)
            losses.append(abs(loss.item() - expected.item()))
        d = max((f - q.detach()).abs().max().item() for f, q in zip(full_values(model), ref.parameters()))
        engine.destroy()
        return f"loss {max(losses):.2e} params {d:.2e}"
    except Exception as x:
        return f"{type(x).__name__}: {str(x)[:400]}"


def generate_body(name, beams, checkpointing):
    model, kind = build(name)
    ref = copy.deepcopy(model)
    if checkpointing:
        model.gradient_checkpointing_enable()
        ref.gradient_checkpointing_enable()
    try:
        engine, *_ = zero_engine.initialize(model=model, config=config(3))
        opt = torch.optim.SGD(ref.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(1)
        same = []
        for i in range(2):
            b = batch(kind, g)
            loss, expected = step_both(ref, opt, engine, b, seed=100 + i)
            inputs = {k: v for k, v in b.items() if k in ("input_ids", "input_features", "pixel_values")}
            ref.eval()
            model.eval()
            with torch.no_grad():
                want = ref.generate(**inputs, max_new_tokens=5, num_beams=beams, do_sample=False)
                got = model.generate(**inputs, max_new_tokens=5, num_beams=beams, do_sample=False)
            ref.train()
            model.train()
            same.append(torch.equal(want, got))
        engine.destroy()
        return same, abs(loss.item() - expected.item())
    except Exception as x:
        return f"{type(x).__name__}: {str(x)[:400]}"


if __name__ == "__main__":
    if sys.argv[1] == "gen":
        for name in sys.argv[2:]:
            for beams in (1, 2):
                for checkpointing in (False, True):
                    result = run_ranks(generate_body, 2, name, beams, checkpointing, timeout=180)[0]
                    print("generate", name, beams, checkpointing, result, flush=True)
    else:
        for name in sys.argv[1:]:
            print(name, 3, run_ranks(train_body, 2, name, 3, timeout=180)[0], flush=True)
