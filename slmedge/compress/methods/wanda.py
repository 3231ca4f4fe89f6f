"""Wanda (Sun et al., 2023): prune by |W| * ||X||, per output row, no weight update.

Score S_ij = |W_ij| * ||X_j||_2 where ||X_j|| is the norm of input feature j over the
calibration tokens. Comparison group: each output row (unstructured) or each M consecutive
weights (N:M), as in the paper.
"""

import torch

from .base import InputNormStats, LinearResult, Method, register_method, rtn_result, single_thread
from .pruning import prune_by_score


@register_method("wanda")
class Wanda(Method):
    kind = "prune"
    stats_class = InputNormStats
    true_sequential = False  # locuslab/wanda collects every linear of a block in one pass
    summary = "Wanda pruning: |weight| x input-activation norm, per output row"

    def compress(self, name, weight, stats):
        with single_thread():  # a few elementwise passes and a top-k per weight: see single_thread
            return self._compress(name, weight, stats)

    def _compress(self, name, weight, stats):
        score = weight.abs() * torch.sqrt(stats.scaler_row.reshape(1, -1))
        mask = prune_by_score(score, self.sparsity, group="row")
        pruned = weight.masked_fill(~mask, 0.0)  # +0.0 where pruned (weight * mask gives -0.0 for negatives)
        if self.quantizes:
            return rtn_result(pruned, self.spec_for(name, weight.shape[1]), mask=mask, importance=self.weighs_by(stats))
        return LinearResult(pruned, mask=mask)
