"""Round-to-nearest: the quantization baseline, no calibration data."""

from .base import Method, register_method, rtn_result


@register_method("rtn")
class RTN(Method):
    kind = "quantize"
    summary = "round-to-nearest quantization (baseline, no calibration)"

    def compress(self, name, weight, stats):
        return rtn_result(weight, self.spec)
