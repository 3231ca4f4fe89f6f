"""Round-to-nearest: the quantization baseline, no calibration data."""

from .base import Method, register_method, rtn_result


@register_method("rtn")
class RTN(Method):
    kind = "quantize"
    summary = "round-to-nearest quantization (baseline, no calibration)"

    def compress(self, name, weight, stats):
        """Rounds ``weight`` in its own storage where it can (the engine hands RTN the linear's own
        fp32 weight, which the result replaces anyway): pass a copy to keep the original."""
        return rtn_result(weight, self.spec, overwrite=True)
