"""`nanreplay import` of a sharded Hugging Face directory (config.json, model.safetensors.index.json,
two *.safetensors shards) of a Qwen2 model, with its AdamW state keyed by parameter name
(get_optimizer_state_dict's layout, torch.save), replayed by `nanreplay run` to the losses the
original PyTorch model computed.

The model follows transformers' Qwen2 modules: Qwen2RMSNorm (hidden * rsqrt(variance + eps), then
weight * hidden), q/k/v biases and none on o_proj, rotate-half rotary from Qwen2RotaryEmbedding's
inv_freq, eager attention with scaling = head_dim^-0.5, untied lm_head. Everything the bundle needs
is read from config.json: attention_bias from model_type qwen2, rope_theta 1e6, rms_norm_eps (0 here,
to plant the incident), use_sliding_window false (so sliding_window is inert), GQA. The embedding
row of token 0 is zero and first read at the last step: nanreplay must name the site, sample and
position PyTorch's forward hooks saw.
"""
import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import import_support as s  # noqa: E402

CONFIG = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 64, "hidden_size": 32,
          "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 32, "rms_norm_eps": 0.0, "rope_theta": 1000000.0, "tie_word_embeddings": False,
          "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 2, "hidden_act": "silu",
          "torch_dtype": "float32", "rope_scaling": None, "attention_dropout": 0.0}
SEQ, MBS, ACCUM, SEED = 16, 2, 2, 7
FIRST, LAST = 3, 6
SITES = [(r"model\.embed_tokens", "embed"), (r"model\.layers\.(\d+)\.input_layernorm", "layers.{}.attn_norm"),
         (r"model\.layers\.(\d+)\.self_attn\.v_proj", "layers.{}.attn.v"),
         (r"model\.layers\.(\d+)\.self_attn\.o_proj", "layers.{}.attn.out"),
         (r"model\.layers\.(\d+)\.post_attention_layernorm", "layers.{}.mlp_norm"),
         (r"model\.layers\.(\d+)\.mlp\.gate_proj", "layers.{}.mlp.gate"),
         (r"model\.layers\.(\d+)\.mlp\.up_proj", "layers.{}.mlp.up"),
         (r"model\.layers\.(\d+)\.mlp\.down_proj", "layers.{}.mlp.down"),
         (r"model\.norm", "final_norm"), (r"lm_head", "logits")]


class Qwen2RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class Qwen2Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.head_dim = c["hidden_size"] // c["num_attention_heads"]
        self.heads, self.kv = c["num_attention_heads"], c["num_key_value_heads"]
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(c["hidden_size"], self.heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(c["hidden_size"], self.kv * self.head_dim, bias=True)
        self.v_proj = nn.Linear(c["hidden_size"], self.kv * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c["hidden_size"], bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        shape = (b, t, -1, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)
        rep = self.heads // self.kv
        k = k[:, :, None].expand(b, self.kv, rep, t, self.head_dim).reshape(b, self.heads, t, self.head_dim)
        v = v[:, :, None].expand(b, self.kv, rep, t, self.head_dim).reshape(b, self.heads, t, self.head_dim)
        w = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        w = w + torch.triu(torch.full((t, t), float("-inf")), 1)
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(w, v).transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(out)


class Qwen2MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c["hidden_size"], c["intermediate_size"], bias=False)
        self.up_proj = nn.Linear(c["hidden_size"], c["intermediate_size"], bias=False)
        self.down_proj = nn.Linear(c["intermediate_size"], c["hidden_size"], bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = Qwen2Attention(c)
        self.mlp = Qwen2MLP(c)
        self.input_layernorm = Qwen2RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.post_attention_layernorm = Qwen2RMSNorm(c["hidden_size"], c["rms_norm_eps"])

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Model(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Qwen2DecoderLayer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = Qwen2RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        dim = c["hidden_size"] // c["num_attention_heads"]
        self.inv_freq = 1.0 / (c["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))

    def forward(self, tokens):
        b, t = tokens.shape
        position_ids = torch.arange(t)[None].expand(b, t)
        inv = self.inv_freq[None, :, None].float().expand(b, -1, 1)
        freqs = (inv @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class Qwen2ForCausalLM(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.model = Qwen2Model(c)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)

    def forward(self, tokens, targets):
        logits = self.lm_head(self.model(tokens)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def save_pretrained(model, out):
    """config.json, two safetensors shards and model.safetensors.index.json, as save_pretrained
    writes them with a small max_shard_size."""
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    names = list(sd)
    split = names.index("model.layers.1.input_layernorm.weight")
    shards = {"model-00001-of-00002.safetensors": names[:split], "model-00002-of-00002.safetensors": names[split:]}
    weight_map = {}
    for file, keys in shards.items():
        s.nanreplay_capture.write_safetensors(out / file, [(k, sd[k]) for k in keys])
        weight_map.update({k: file for k in keys})
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(v.numel() * 4 for v in sd.values())}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    torch.set_num_threads(1)

    data = s.Data(work, CONFIG["vocab_size"], SEQ, MBS, ACCUM, num_samples=64, seed=SEED, pad_at=(LAST, 0, 1, 9))
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(CONFIG)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("_proj.bias"):
                p.normal_(0.0, 0.3)
        model.model.embed_tokens.weight[s.PAD].zero_()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    nodecay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = s.adamw([{"params": decay, "weight_decay": 0.1}, {"params": nodecay, "weight_decay": 0.0}])

    def save():
        save_pretrained(model, work / "hf-step3")
        torch.save(s.name_keyed(model, opt), work / "optimizer.pt")

    proc, manifest = s.incident_case("hf", args.cli, work, model, opt, data, SITES, save, FIRST, LAST,
                                     ["--checkpoint", work / "hf-step3", "--optimizer", work / "optimizer.pt"])
    s.check("format: hf (detected: model.safetensors.index.json; 2 file(s))" in proc.stdout,
            "auto-detected a sharded Hugging Face directory")
    s.check("naming: hf (detected: model.embed_tokens.weight)" in proc.stdout, "auto-detected HF naming")
    if manifest:
        m, o = manifest["model"], manifest["optimizer"]
        s.check(m.get("attention_bias") is True and m["rope_theta"] == 1e6 and m["norm_eps"] == 0.0
                and m["num_kv_heads"] == 2 and "sliding_window" not in m and "rope_style" not in m
                and m["max_seq_len"] == 32, f"model from config.json {m}")
        s.check(sorted(o.get("no_decay", [])) == sorted(n for n, p in model.named_parameters() if p.dim() < 2),
                f"no_decay: the parameters of the weight_decay 0 group ({len(o.get('no_decay', []))})")
    return s.finish()


if __name__ == "__main__":
    sys.exit(main())
