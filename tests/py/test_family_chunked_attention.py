"""Llama 4's chunked attention against eager PyTorch written from transformers' masking_utils.py and
modeling_llama4.py, over a sequence of three chunks so the mask matters.

The mask is transcribed from transformers' masking_utils.py: causal_mask_function (kv_idx <= q_idx),
chunked_overlay ((kv_idx - left_padding) // chunk_size == (q_idx - left_padding) // chunk_size; no padding
here, so left_padding is 0), and_masks, chunked_causal_mask_function, expanded over (query, key) by index
broadcasting as _non_vmap_expansion_sdpa does, then made additive as eager_mask does (0 where attended,
finfo(fp32).min elsewhere). Llama4TextModel.forward builds create_causal_mask for "full_attention" and
create_chunked_causal_mask for "chunked_attention", and each decoder layer takes the mask of its
config.layer_types entry; Llama4TextConfig derives layer_types as "chunked_attention" where no_rope_layers
is 1 (the rotary layers) and "full_attention" on the NoPE layers. (transformers 4.51 chose the chunked
layers by index, int((layer_idx + 1) % 4 != 0), in Llama4TextDecoderLayer; later 4.5x read no_rope_layers;
transformers 5 reads layer_types. All three agree on Llama 4's own configs, whose NoPE layers are every
fourth.) The attention, rotary, norms and MLP are test_family_llama4_attn.py's transcription, imported.

1. A one-step fp32 bundle (no_rope_layers [1, 0], attention_chunk_size 6, data.seq_len 16: chunks of 6, 6
   and 4): loss and gradient norm within 1e-5 relative.
2. The same with layer_types ["chunked_attention", "full_attention"] given: the same loss.
3. The same weights with chunking off (no attention_chunk_size): nanreplay replays the unchunked
   reference, and its loss departs from the chunked one.
4. `nanreplay inspect` names layer 0 chunked and layer 1 full.
5. The bundle of 1. in bf16 (precision.compute "bf16"): the reference rounds where the bundle format does
   (docs/bundle-format.md, "Precision as replayed": every linear's input, weight and bias, q k^T and the
   scaled scores, every probe site as it is produced, the L2 QK-norm's input); the chunk mask is added to
   the rounded scores in fp32. Loss and gradient norm within 1e-4 relative, and that loss departs from the
   fp32 one.

    /usr/bin/python3 tests/py/test_family_chunked_attention.py --cli build/nanreplay --work DIR
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import family_support as fs  # noqa: E402
import test_family_llama4_attn as l4  # noqa: E402  (Llama 4's layers, transcribed from modeling_llama4.py)

CHUNK = 6              # data.seq_len 16 = chunks of 6, 6, 4
NO_ROPE_LAYERS = [1, 0]  # layer 0 rotary (chunked), layer 1 NoPE (full causal)


# ---- transformers' masking_utils.py, transcribed ---------------------------------------------------

def and_masks(*mask_functions):
    def and_mask(batch_idx, head_idx, q_idx, kv_idx):
        result = q_idx.new_ones((), dtype=torch.bool)
        for mask in mask_functions:
            result = result & mask(batch_idx, head_idx, q_idx, kv_idx)
        return result
    return and_mask


def causal_mask_function(batch_idx, head_idx, q_idx, kv_idx):
    return kv_idx <= q_idx


def chunked_overlay(chunk_size, left_padding):
    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return (kv_idx - left_padding[batch_idx]) // chunk_size == (q_idx - left_padding[batch_idx]) // chunk_size
    return inner_mask


def chunked_causal_mask_function(chunk_size, left_padding):
    return and_masks(chunked_overlay(chunk_size, left_padding), causal_mask_function)


def eager_mask(mask_function, batch_size, seq):
    """sdpa_mask's index broadcasting (_non_vmap_expansion_sdpa), then eager_mask's additive form."""
    batch = torch.arange(batch_size)[:, None, None, None]
    head = torch.arange(1)[None, :, None, None]
    q_idx = torch.arange(seq)[None, None, :, None]
    kv_idx = torch.arange(seq)[None, None, None, :]
    allowed = mask_function(batch, head, q_idx, kv_idx).expand(batch_size, 1, seq, seq)
    min_dtype = torch.finfo(torch.float32).min
    return torch.where(allowed, torch.tensor(0.0), torch.tensor(min_dtype))


# ---- Llama4TextModel's per-layer masks over test_family_llama4_attn.py's layers ---------------------

class Llama4TextChunked(fs.Rounding, torch.nn.Module):
    def __init__(self, no_rope_layers, chunk_size):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(l4.V, l4.C)
        self.layers = torch.nn.ModuleList([l4.Llama4TextDecoderLayer(bool(r), True) for r in no_rope_layers])
        self.norm = l4.Llama4TextRMSNorm(l4.C)
        self.lm_head = fs.Linear(l4.C, l4.V, bias=False)
        self.inv_freq, self.attention_scaling = l4.compute_llama3_parameters(l4.D, l4.THETA, l4.ROPE)
        self.chunk_size = chunk_size
        # Llama4TextConfig: layer_types from no_rope_layers (chunked where the layer is rotary).
        self.layer_types = ["chunked_attention" if r else "full_attention" for r in no_rope_layers]

    def forward(self, input_ids, labels):
        batch_size, seq = input_ids.shape
        cache_position = torch.arange(seq)
        position_ids = cache_position[None, :].float()
        freqs = (self.inv_freq[None, :, None].float() @ position_ids[:, None, :]).transpose(1, 2)
        freqs_cis = torch.polar(torch.ones_like(freqs), freqs) * self.attention_scaling
        left_padding = torch.zeros(batch_size, dtype=torch.long)  # no padding mask: nothing on the left
        masks = {"full_attention": eager_mask(causal_mask_function, batch_size, seq)}
        if self.chunk_size:
            masks["chunked_attention"] = eager_mask(chunked_causal_mask_function(self.chunk_size, left_padding),
                                                    batch_size, seq)
        hidden_states = self.rnd(self.embed_tokens(input_ids))  # embed
        for layer, layer_type in zip(self.layers, self.layer_types):
            mask = masks[layer_type if self.chunk_size else "full_attention"]
            hidden_states = layer(hidden_states, mask, freqs_cis, cache_position)
        return fs.cross_entropy(self.rnd(self.lm_head(self.norm(hidden_states))), labels)  # logits


MODEL = dict(l4.MODEL, no_rope_layers=NO_ROPE_LAYERS, attention_chunk_size=CHUNK)


def replay_loss(cli, work, name, model, weights, stream, loss, norm):
    """The replayed report of `model` over the same weights and tokens (None when nanreplay gave none)."""
    bundle = fs.write_bundle(work / name, model, weights, stream, l4.SAMPLES, l4.T, loss, norm)
    rc, report, err = fs.replay(cli, bundle, work / f"out-{name}")
    fs.check(report is not None and report.get("steps"), f"{name}: nanreplay run gave a report (exit {rc}; {err.strip()[-300:]})")
    return bundle, report


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    fs.check(l4.T > 2 * CHUNK, f"data.seq_len {l4.T} spans three chunks of {CHUNK}")
    torch.manual_seed(0)
    model = Llama4TextChunked(NO_ROPE_LAYERS, CHUNK)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape) if "norm" in name else 0.4 * torch.randn(p.shape))
    stream = fs.token_stream(l4.V, l4.SAMPLES, l4.T, seed=4)
    inputs, targets = fs.batch_of(stream, l4.SAMPLES, l4.T)
    loss, norm = fs.loss_and_grad_norm(model(inputs, targets), list(model.parameters()))
    weights = l4.named(model)

    bundle, report = replay_loss(args.cli, work, "chunked", MODEL, weights, stream, loss, norm)
    if report:
        fs.compare_step(report, loss, norm, f"chunked attention (chunks of {CHUNK} over {l4.T} positions)")

    listed = dict(MODEL, layer_types=["chunked_attention", "full_attention"])
    _, report = replay_loss(args.cli, work, "listed", listed, weights, stream, loss, norm)
    if report:
        fs.compare_step(report, loss, norm, "layer_types naming chunked_attention")

    fs.check_bf16_step(args.cli, work, "chunked-bf16", MODEL, model, l4.named, stream, l4.SAMPLES, l4.T,
                       f"chunked attention in bf16 (chunks of {CHUNK} over {l4.T} positions)")

    unchunked = Llama4TextChunked(NO_ROPE_LAYERS, None)
    unchunked.load_state_dict(model.state_dict())
    off_loss, off_norm = fs.loss_and_grad_norm(unchunked(inputs, targets), list(unchunked.parameters()))
    off = {k: v for k, v in MODEL.items() if k != "attention_chunk_size"}
    _, report = replay_loss(args.cli, work, "off", off, weights, stream, off_loss, off_norm)
    if report:
        fs.compare_step(report, off_loss, off_norm, "chunking off (full causal attention)")
        fs.check(fs.rel_err(report["steps"][0]["loss"], loss) > 1e-4,
                 f"chunking off departs from the chunked loss ({report['steps'][0]['loss']} vs {loss})")

    proc = subprocess.run([args.cli, "inspect", str(bundle), "--json"], capture_output=True, text=True)
    summary = json.loads(proc.stdout) if proc.returncode == 0 else {}
    fs.check(summary.get("model", {}).get("layer_types") == ["chunked_attention", "full_attention"]
             and summary["model"].get("attention_chunk_size") == CHUNK,
             f"inspect --json names layer 0 chunked, layer 1 full (exit {proc.returncode}: {summary.get('model')})")
    proc = subprocess.run([args.cli, "inspect", str(bundle)], capture_output=True, text=True)
    fs.check("0 chunked, 1 full (chunk 6)" in proc.stdout, f"inspect's attention line ({proc.stdout.strip()[:400]})")
    fs.finish()


if __name__ == "__main__":
    main()
