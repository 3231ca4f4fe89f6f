"""Magnitude pruning: the pruning baseline, no calibration data.

Comparison group as in the Wanda paper's magnitude baseline: the whole layer for unstructured
sparsity; each M consecutive weights of a row for N:M.
"""

from .base import LinearResult, Method, register_method, rtn_result, single_thread
from .pruning import prune_by_score


@register_method("magnitude")
class Magnitude(Method):
    kind = "prune"
    summary = "magnitude pruning (baseline, no calibration)"

    def compress(self, name, weight, stats):
        with single_thread():  # a few elementwise passes and a top-k per weight: see single_thread
            return self._compress(name, weight, stats)

    def _compress(self, name, weight, stats):
        mask = prune_by_score(weight.abs(), self.sparsity, group="layer")
        pruned = weight.masked_fill(~mask, 0.0)  # +0.0 where pruned (weight * mask gives -0.0 for negatives)
        if self.quantizes:
            return rtn_result(pruned, self.spec_for(name, weight.shape[1]), mask=mask)
        return LinearResult(pruned, mask=mask)

