"""torch: a model source (an artifact, a Hugging Face folder, an imported GGUF) run in process."""

from __future__ import annotations

import warnings
from contextlib import contextmanager

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

    # Tokens per pass of ``sequence_scores``/``sequence_outputs`` (windows of one length run together):
    # a streamed model reads every block once per pass, so a pass takes many windows; the activations
    # of a pass are small beside the weights (the logits are made one window at a time).
    batch_tokens = 4096

    def __init__(self, model, threads: int | None = None, device: str = "cpu", streamed=None):
        """``model``: a transformers causal LM, whole; or, with ``streamed`` (a ``models.streamed.StreamedModel``),
        that object's model, whose decoder blocks its own forward pass reads one at a time (CPU only)."""
        import torch

        super().__init__(threads)
        torch.set_num_threads(self.threads)
        self.torch = torch
        self.device = device
        self.streamed = streamed
        if streamed is not None and device != "cpu":
            raise ValueError(f"a streamed model runs on the CPU, not {device}")
        self.model = (model if streamed is not None else model.to(device)).eval()

    @classmethod
    def open_streamed(cls, path, threads: int | None = None) -> "TorchRuntime":
        """The model folder at ``path`` (an artifact of either version, a Hugging Face folder with
        safetensors) run with one decoder block in fp32 in memory at a time: the same logits, bit for bit."""
        from ..models.streamed import StreamedModel

        sm = StreamedModel(path)
        return cls(sm.model, threads, streamed=sm)

    @contextmanager
    def _pass(self):
        """One or more forward passes without gradients; a streamed model's blocks are all freed after
        them, also when one stopped inside a block."""
        try:
            with self.torch.no_grad():
                yield
        finally:
            if self.streamed is not None:
                self.streamed.free_all()

    def close(self) -> None:
        if self.streamed is not None:
            self.streamed.close()
            self.streamed = None

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def logits(self, ids):
        return next(self.sequence_outputs([list(ids)]))[0]

    def _batches(self, seqs):
        """Runs of consecutive sequences of one length, at most ``batch_tokens`` tokens each (at least one
        sequence): they need no padding, so each row is computed as it would be alone."""
        batch: list[int] = []
        for i, s in enumerate(seqs):
            if batch and (len(s) != len(seqs[batch[0]]) or (len(batch) + 1) * len(s) > self.batch_tokens):
                yield batch
                batch = []
            batch.append(i)
        if batch:
            yield batch

    def _last_hidden(self, rows, mask: bool):
        """The decoder's final hidden states (B, T, H) of equal-length rows; ``mask``: with an all-ones
        attention mask, as the padded scoring path passes one (its bits are kept)."""
        torch = self.torch
        ids = torch.tensor(rows, dtype=torch.long, device=self.device)
        kw = {"attention_mask": torch.ones_like(ids)} if mask else {}
        # not base_model_prefix: Gemma 3's names a module it does not have
        return self.model.get_decoder()(input_ids=ids, use_cache=False, **kw).last_hidden_state

    def sequence_scores(self, seqs):
        # Rows are each window but its last token, as continuation_scores(seq[:1], [seq[1:]]) runs them;
        # the head is applied one row at a time, so only one window's logits (T, V) exist at once.
        seqs = [list(s) for s in seqs]
        for batch in self._batches([s[:-1] for s in seqs]):
            with self._pass():
                hidden = self._last_hidden([seqs[i][:-1] for i in batch], mask=True)
            for r, i in enumerate(batch):
                yield _token_scores(self._row_logits(hidden[r]), seqs[i][1:], self.torch_lse)

    def sequence_outputs(self, seqs, hidden: bool = False):
        seqs = [list(s) for s in seqs]
        for batch in self._batches(seqs):
            with self._pass():
                states = self._last_hidden([seqs[i] for i in batch], mask=False)
            for r in range(len(batch)):  # nothing is yielded inside a pass: no grad mode left to the caller
                yield self._row_logits(states[r]), (states[r].float().cpu().numpy() if hidden else None)

    def _row_logits(self, hidden):
        """(T, V) fp32 logits of one row's final hidden states (T, H)."""
        with self.torch.no_grad():
            return self._head(hidden).float().cpu().numpy()

    def continuation_scores(self, context, continuations):
        # The context (but its last token) runs once and its KV cache is shared by the
        # continuations (``_packed_scores`` with one group: no padding in the prefix, so this also
        # holds for sliding-window models).
        torch = self.torch
        ctx = list(context)
        if len(ctx) > 1 and len(continuations) > 0 and self.packing:
            return self._packed_or_alone([(ctx, continuations)])[0]  # failing, it comes back here unpacked
        ids, mask = _padded(ctx, continuations, 0)
        with self._pass():
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
        with self._pass():
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
        return next(self.sequence_outputs([list(ids)], hidden=True))[1]

    def _prefill(self, ids):
        with self._pass():
            out = self.model(self.torch.tensor([ids], device=self.device), use_cache=True)
        return out.logits[0, -1].float().cpu().numpy(), out.past_key_values

    def _step(self, token, state, position):
        with self._pass():
            out = self.model(self.torch.tensor([[token]], device=self.device), past_key_values=state, use_cache=True)
        return out.logits[0, -1].float().cpu().numpy(), out.past_key_values
