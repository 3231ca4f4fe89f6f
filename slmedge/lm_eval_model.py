"""An lm-evaluation-harness model class: any of lm-eval's tasks on any slmedge runtime.

    slmedge lm-eval --model slmedge --model_args model=out/awq.gguf --tasks arc_easy
    slmedge lm-eval --model slmedge --model_args model=onnx_dir,threads=2 --tasks hellaswag --limit 100

``model`` is anything ``slmedge evaluate`` accepts (artifact, model source, .gguf, ONNX export);
``runtime`` overrides the one that follows from the file. Requests are scored with the same code
as ``slmedge evaluate --tasks`` (lm-eval's ``_encode_pair`` tokenization; continuations of one
context scored together). ``slmedge lm-eval`` is lm-eval's own command line with this class
registered as ``slmedge`` (needs ``pip install lm_eval``).
"""

from __future__ import annotations

try:
    import lm_eval.models  # noqa: F401 - lm-eval's own classes (hf, ...) register when this is imported
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as exc:  # pragma: no cover - only without the optional dependency
    from .errors import RuntimeNotInstalledError

    raise RuntimeNotInstalledError("lm-evaluation-harness is not installed; install it with: pip install lm_eval") from exc

import numpy as np

from .errors import ConfigError
from .evaluate.subject import open_subject
from .limits import check, check_length, check_threads, usable_cpus
from .models.shape import model_shape
from .evaluate.tasks import encode_pair, score_pairs


@register_model("slmedge")
class SlmedgeLM(LM):
    def __init__(self, model: str | None = None, runtime: str | None = None, threads: int | None = None,
                 max_length: int | None = None, max_gen_toks: int = 256, **kwargs):
        super().__init__()
        # The ranges of slmedge.limits, and the lengths against the model's positions, before it opens.
        shape = model_shape(model)
        positions = shape.positions if shape is not None else None
        if max_length is None:  # lm-eval's usual 2048, or the model's positions where it has fewer
            max_length = min(DEFAULT_MAX_LENGTH, positions) if positions else DEFAULT_MAX_LENGTH
        self.max_length = _number("max_length", max_length, "context")
        self.max_gen_toks = _number("max_gen_toks", max_gen_toks, "tg")
        threads = _number("threads", threads, "threads") if threads else None
        for name, value in (("max_length", self.max_length), ("max_gen_toks", self.max_gen_toks)):
            if shape is not None:
                check_length(name, value, positions, shape.positions_from)
        check_threads(threads, usable_cpus(), "threads", "this machine")
        self.sub = open_subject(model, runtime, threads, n_ctx=self.max_length + 8)
        self.rt, self.enc = self.sub.runtime, self.sub.encoder

    # -- loglikelihood ------------------------------------------------------------------------

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        pairs = [encode_pair(self.enc, *req.args[:2]) for req in requests]
        return [(float(lp.sum()), bool(greedy)) for lp, greedy in score_pairs(self.rt, pairs, self.max_length)]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        prefix = self.enc.eos_id if self.enc.eos_id is not None else self.enc.bos_id
        out = []
        for req in requests:
            ids = self.enc.encode(req.args[0])
            total = 0.0
            # Disjoint windows, each predicting up to max_length tokens from what precedes them
            # (lm-eval's get_rolling_token_windows with context_len=1).
            for start in range(0, len(ids), self.max_length):
                target = ids[start : start + self.max_length]
                context = [prefix] if start == 0 else [ids[start - 1]]
                lp, _ = self.rt.continuation_scores(context, [target])[0]
                total += float(lp.sum())
            out.append(total)
        return out

    # -- generation ---------------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False):
        out = []
        for req in requests:
            context, kwargs = req.args[0], dict(req.args[1] or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            ids = self.enc.encode(context)[-(self.max_length - max_new):] or [self.enc.bos_id or 0]
            text = self._greedy(ids, max_new, until)
            out.append(text)
        return out

    def _greedy(self, ids, max_new, until) -> str:
        tok = self.sub.encoder.tok if hasattr(self.sub.encoder, "tok") else None
        last, state = self.rt._prefill(list(ids))
        generated: list[int] = []
        for i in range(max_new):
            token = int(np.argmax(last))
            if token == self.enc.eos_id:
                break
            generated.append(token)
            text = tok.decode(generated) if tok is not None else self.rt.llm.detokenize(generated).decode("utf-8", "ignore")
            cut = min((text.find(u) for u in until if u and u in text), default=-1)
            if cut >= 0:
                return text[:cut]
            last, state = self.rt._step(token, state, len(ids) + i)
        return tok.decode(generated) if tok is not None else self.rt.llm.detokenize(generated).decode("utf-8", "ignore")


DEFAULT_MAX_LENGTH = 2048  # lm-eval's own models' default


def _number(name: str, value, key: str) -> int:
    """A --model_args number (lm-eval passes text or an int) in the range slmedge.limits declares for ``key``."""
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"--model_args {name} must be an integer, got {value!r}") from None
    return check(key, number, f"--model_args {name}")


def main() -> None:  # pragma: no cover - a thin wrapper around lm-eval's own CLI
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":  # pragma: no cover
    main()
