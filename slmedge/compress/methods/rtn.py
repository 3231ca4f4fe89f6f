"""Round-to-nearest: the quantization baseline; on llama.cpp's grids, importance-weighted rounding.

On the uniform grid RTN is data-free (min/max scales). On a llama.cpp grid each block's scale is
searched (``compress.grid_fit``); with ``importance`` set in the recipe the search weighs every
weight by its input channel's mean square over the calibration tokens (an importance matrix, the
statistics ``llama-imatrix`` computes), otherwise by a data-free weighting.
"""

from .base import InputNormStats, Method, register_method, rtn_result


@register_method("rtn")
class RTN(Method):
    kind = "quantize"
    summary = "round-to-nearest quantization (baseline; importance-weighted scales on a llama.cpp grid)"
    # One pass per block: the statistics of every linear are those of the block's input as compressed so
    # far (later blocks see earlier blocks rounded), as llama.cpp's importance matrix is one forward.
    true_sequential = False

    def __init__(self, recipe):
        super().__init__(recipe)
        # An instance attribute: calibration statistics only when importance-weighted rounding is asked for.
        self.stats_class = InputNormStats if recipe.importance else None

    def compress(self, name, weight, stats):
        """Rounds ``weight`` in its own storage where it can (the engine hands RTN the linear's own
        fp32 weight, which the result replaces anyway): pass a copy to keep the original."""
        return rtn_result(weight, self.spec_for(name, weight.shape[1]), overwrite=True,
                          importance=self.weighs_by(stats))
