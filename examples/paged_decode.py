"""Paged decode with a tiny Llama: the KV cache lives in pages, attention is tpukernels' ragged paged
attention, the cache is written with ``update_kv_cache``: two tpukernels ops per layer and step, the way a
server (vLLM TPU, SGLang) runs a model. Greedy tokens are compared with stock Hugging Face ``generate``.

    python examples/paged_decode.py              # cpu (Pallas interpret mode); exits non-zero on a mismatch

The model is built from a config (random weights, no download): 2 layers, 4 query heads and 2 kv heads of
``D = 128``, float32. Two prompts of different lengths are prefilled together in one ragged batch (one
``ragged_paged_attention`` call over both sequences), then decoded together (one query token per sequence
per step). Pages are handed out from a free list, so each sequence's pages are scattered in the cache.
"""

from __future__ import annotations

import sys

import torch

from tpukernels.library import ragged_paged_attention, update_kv_cache

PAGE_SIZE = 4


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=128, max_position_embeddings=256,
                      initializer_range=0.2, attn_implementation="eager")
    return LlamaForCausalLM(cfg).eval()


class PagedCache:
    """Per-layer caches ``[num_pages, PAGE_SIZE, 2*Hkv, D]`` and each sequence's page list."""

    def __init__(self, model, num_pages: int, max_pages_per_seq: int, num_seqs: int):
        c = model.config
        self.layers = [torch.zeros(num_pages, PAGE_SIZE, 2 * c.num_key_value_heads, c.head_dim)
                       for _ in range(c.num_hidden_layers)]
        self.free = list(torch.randperm(num_pages).tolist())  # scattered pages
        self.page_indices = torch.zeros(num_seqs, max_pages_per_seq, dtype=torch.int32)
        self.lens = [0] * num_seqs

    def slots(self, s: int, n: int) -> list[int]:
        """Reserve slots for ``n`` new tokens of sequence ``s`` (allocating pages); returns their slot ids."""
        out = []
        for pos in range(self.lens[s], self.lens[s] + n):
            if pos % PAGE_SIZE == 0:
                self.page_indices[s, pos // PAGE_SIZE] = self.free.pop()
            out.append(int(self.page_indices[s, pos // PAGE_SIZE]) * PAGE_SIZE + pos % PAGE_SIZE)
        self.lens[s] += n
        return out


@torch.no_grad()
def step(model, cache: PagedCache, tokens: list[list[int]]) -> torch.Tensor:
    """One forward over a ragged batch: ``tokens[s]`` are sequence s's new tokens. Returns next-token logits
    of each sequence's last new token, ``[S, vocab]``."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    c = model.config
    Hq, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    pos = torch.tensor([cache.lens[s] + i for s, t in enumerate(tokens) for i in range(len(t))])
    slots = torch.tensor([x for s, t in enumerate(tokens) for x in cache.slots(s, len(t))], dtype=torch.int32)
    q_lens = [len(t) for t in tokens]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    kv_lens = torch.tensor(cache.lens, dtype=torch.int32)
    num_seqs = torch.tensor([len(tokens)], dtype=torch.int32)
    T = len(pos)
    x = model.model.embed_tokens(torch.tensor([t for ts in tokens for t in ts]))[None]  # [1, T, hidden]
    cos, sin = model.model.rotary_emb(x, pos[None])
    for li, layer in enumerate(model.model.layers):
        a = layer.self_attn
        h = layer.input_layernorm(x)
        q = a.q_proj(h).view(1, T, Hq, D).transpose(1, 2)
        k = a.k_proj(h).view(1, T, Hkv, D).transpose(1, 2)
        v = a.v_proj(h).view(1, T, Hkv, D)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        cache.layers[li] = update_kv_cache(cache.layers[li], k[0].transpose(0, 1).contiguous(), v[0].contiguous(),
                                           slots)
        o = ragged_paged_attention(q[0].transpose(0, 1).contiguous(), cache.layers[li], kv_lens, cache.page_indices,
                                   cu, num_seqs, sm_scale=a.scaling)
        x = x + a.o_proj(o.reshape(1, T, Hq * D))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    last = cu[1:] - 1
    return model.lm_head(model.model.norm(x[0, last]))


def paged_generate(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy generation of ``new_tokens`` per prompt, all prompts batched, paged KV cache."""
    total = max(len(p) for p in prompts) + new_tokens
    cache = PagedCache(model, num_pages=len(prompts) * (-(-total // PAGE_SIZE)) + 3,
                       max_pages_per_seq=-(-total // PAGE_SIZE), num_seqs=len(prompts))
    out = [[] for _ in prompts]
    feed = [list(p) for p in prompts]
    for _ in range(new_tokens):
        nxt = step(model, cache, feed).argmax(-1).tolist()
        for s, t in enumerate(nxt):
            out[s].append(t)
        feed = [[t] for t in nxt]
    return out


@torch.no_grad()
def hf_generate(model, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    g = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return g[0, len(prompt):].tolist()


def main(new_tokens: int = 6) -> int:
    model = tiny_llama()
    prompts = [[5, 17, 99, 3, 42, 7, 64], [11, 200, 31]]
    ours = paged_generate(model, prompts, new_tokens)
    failures = 0
    for p, got in zip(prompts, ours):
        want = hf_generate(model, p, new_tokens)
        ok = got == want
        failures += not ok
        print(f"prompt of {len(p)} tokens: paged {got} vs HF {want}: {'ok' if ok else 'MISMATCH'}")
    return failures


if __name__ == "__main__":
    sys.exit(1 if main() else 0)
