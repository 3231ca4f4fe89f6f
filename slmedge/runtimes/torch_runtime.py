"""torch: a model source (an artifact, a Hugging Face folder, an imported GGUF) run in process."""

from __future__ import annotations

import warnings

import numpy as np

from .base import Runtime, _token_scores
from .registry import register_runtime


def _padded(context, continuations, pad: int):
    seqs = [list(context) + list(c)[:-1] for c in continuations]
    width = max(len(s) for s in seqs)
    ids = np.full((len(seqs), width), pad, dtype=np.int64)
    mask = np.zeros((len(seqs), width), dtype=np.int64)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    return ids, mask


def torch_tanh_cap(logits, cap: float):
    """Gemma's final logit soft-capping."""
    import torch

    return torch.tanh(logits / cap) * cap


@register_runtime("torch", aliases=("pytorch",), package="torch", install="pip install torch")
class TorchRuntime(Runtime):
    torch_lse = True
    # The shared-prefix path needs a KV cache that can repeat its rows; set False (with one warning)
    # the first time it fails, after which every group runs as whole sequences.
    packing = True

    def __init__(self, model, threads: int | None = None, device: str = "cpu"):
        import torch

        super().__init__(threads)
        torch.set_num_threads(self.threads)
        self.torch = torch
        self.device = device
        self.model = model.to(device).eval()

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def logits(self, ids):
        with self.torch.no_grad():
            out = self.model(self.torch.tensor([list(ids)], device=self.device), use_cache=False)
        return out.logits[0].float().cpu().numpy()

    def continuation_scores(self, context, continuations):
        # The context (but its last token) runs once and its KV cache is shared by the
        # continuations (``_packed_scores`` with one group: no padding in the prefix, so this also
        # holds for sliding-window models).
        torch = self.torch
        ctx = list(context)
        if len(ctx) > 1 and len(continuations) > 0 and self.packing:
            return self._packed_or_alone([(ctx, continuations)])[0]  # failing, it comes back here unpacked
        ids, mask = _padded(ctx, continuations, 0)
        with torch.no_grad():
            logits = self.model(torch.from_numpy(ids).to(self.device),
                                attention_mask=torch.from_numpy(mask).to(self.device), use_cache=False).logits
        logits = logits.float().cpu().numpy()
        n = len(ctx)
        return [_token_scores(logits[i, n - 1 : n - 1 + len(c)], c, self.torch_lse)
                for i, c in enumerate(continuations)]

    def _stop_packing(self, error: Exception) -> None:
        # Caches without batch selection (e.g. some hybrid caches) cannot share a prefix. Said
        # once, not silently: a bug in the fast path also lands here, and the plain path is several
        # times slower on a large vocabulary (every position goes through the head).
        self.packing = False
        warnings.warn(f"{type(self.model).__name__}: shared-prefix scoring failed ({type(error).__name__}: {error}); "
                      "scoring whole sequences from here on (slower)", RuntimeWarning, stacklevel=3)

    def _packed_or_alone(self, groups):
        if self.packing:
            try:
                return self._packed_scores(groups)
            except (AttributeError, NotImplementedError, TypeError) as e:
                self._stop_packing(e)
        return [self.continuation_scores(*g) for g in groups]

    # Tokens per packed forward pass: small models on a CPU run several times faster per token
    # at a few hundred rows than at one short sequence (measured on SmolLM2-135M, 2 threads).
    pack_tokens = 384

    def _attention_window(self) -> int | None:
        """The smallest sliding window of any layer, None when every layer attends to everything."""
        cfg = self.model.config
        window = getattr(cfg, "sliding_window", None)
        sliding = window and getattr(cfg, "use_sliding_window", True)
        if sliding or any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
            return int(window or 0)
        return None

    def score_groups(self, groups):
        # Packed rows sit behind their batch's longest prefix, so their slots are further apart than
        # their positions. A sliding window (Gemma 2/3, Mistral) masks by slot: packing is exact
        # only while a whole packed row (prefix slots + continuation) fits in the window, where
        # no key is ever outside it; longer groups run alone (no padding, slots == positions).
        window = self._attention_window()
        out: list = [None] * len(groups)

        def span(i):
            return len(groups[i][0]) - 1 + max(len(c) for c in groups[i][1])

        alone = [i for i, (ctx, conts) in enumerate(groups)
                 if len(ctx) <= 1 or not conts or (window is not None and span(i) > window)]
        for i in alone:
            out[i] = self.continuation_scores(*groups[i])
        skip = set(alone)
        order = sorted((i for i in range(len(groups)) if i not in skip), key=lambda i: -(span(i) + 1))
        batch: list[int] = []
        for i in order:
            trial = batch + [i]
            p = max(len(groups[j][0]) - 1 for j in trial)
            w = max(len(c) for j in trial for c in groups[j][1])
            n = sum(len(groups[j][1]) for j in trial)
            if batch and (len(trial) * p + n * w > self.pack_tokens or (window is not None and p + w > window)):
                for j, r in zip(batch, self._packed_or_alone([groups[j] for j in batch])):
                    out[j] = r
                batch = [i]
            else:
                batch = trial
        if batch:
            for j, r in zip(batch, self._packed_or_alone([groups[j] for j in batch])):
                out[j] = r
        return out

    def _packed_scores(self, groups):
        # Prefixes (each context but its last token) run as one right-padded batch into a KV
        # cache; its rows are repeated per continuation; the continuations then run as one
        # right-padded batch with explicit positions, their mask hiding the prefixes' pads.
        torch = self.torch
        from transformers import DynamicCache

        base = self.model.get_decoder()  # not base_model_prefix: Gemma 3's names a module it does not have
        plen = [len(ctx) - 1 for ctx, _ in groups]
        p = max(plen)
        rows = [(g, c) for g, (_, conts) in enumerate(groups) for c in conts]
        seqs = [[groups[g][0][-1], *list(c)[:-1]] for g, c in rows]
        w = max(len(x) for x in seqs)
        pre = torch.zeros((len(groups), p), dtype=torch.long)
        pre_mask = torch.zeros((len(groups), p), dtype=torch.long)
        for g, (ctx, _) in enumerate(groups):
            pre[g, : plen[g]] = torch.tensor(ctx[:-1])
            pre_mask[g, : plen[g]] = 1
        ids = torch.zeros((len(rows), w), dtype=torch.long)
        mask = torch.zeros((len(rows), p + w), dtype=torch.long)
        pos = torch.zeros((len(rows), w), dtype=torch.long)
        for r, ((g, _), x) in enumerate(zip(rows, seqs)):
            ids[r, : len(x)] = torch.tensor(x)
            mask[r, : plen[g]] = 1
            mask[r, p : p + len(x)] = 1
            pos[r] = torch.arange(plen[g], plen[g] + w)
        dev = self.device
        with torch.no_grad():
            cache = DynamicCache(config=self.model.config)
            base(input_ids=pre.to(dev), attention_mask=pre_mask.to(dev), past_key_values=cache, use_cache=True)
            cache.batch_select_indices(torch.tensor([g for g, _ in rows], device=dev))
            hidden = base(input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev),
                          past_key_values=cache, use_cache=True).last_hidden_state
            picked = torch.cat([hidden[r, : len(c)] for r, (_, c) in enumerate(rows)])
            logits = self._head(picked).float().cpu().numpy()
        out: list[list] = [[] for _ in groups]
        at = 0
        for g, c in rows:
            out[g].append(_token_scores(logits[at : at + len(c)], c, self.torch_lse))
            at += len(c)
        return out

    def _head(self, hidden):
        logits = self.model.lm_head(hidden)
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        return torch_tanh_cap(logits, cap) if cap else logits

    def hidden_states(self, ids):
        with self.torch.no_grad():
            out = self.model(self.torch.tensor([list(ids)], device=self.device), use_cache=False,
                             output_hidden_states=True)
        return out.hidden_states[-1][0].float().cpu().numpy()

    def _prefill(self, ids):
        with self.torch.no_grad():
            out = self.model(self.torch.tensor([ids], device=self.device), use_cache=True)
        return out.logits[0, -1].float().cpu().numpy(), out.past_key_values

    def _step(self, token, state, position):
        with self.torch.no_grad():
            out = self.model(self.torch.tensor([[token]], device=self.device), past_key_values=state, use_cache=True)
        return out.logits[0, -1].float().cpu().numpy(), out.past_key_values
