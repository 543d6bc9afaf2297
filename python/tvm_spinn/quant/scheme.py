"""Post-training quantization options (:class:`QuantScheme`) and their error type.

A scheme is a frozen dataclass validated on construction; every refusal is a
:class:`QuantizationError` naming the field, the value and what is supported. Schemes may also be
given as a short string (see :meth:`QuantScheme.parse`), e.g. ``"int8"``, ``"uint8,per-tensor"``
or ``"int8,percentile=99.9,symmetric"``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from numbers import Real

__all__ = ["QuantizationError", "QuantScheme", "as_scheme"]

ACTIVATION_DTYPES = ("int8", "uint8")
WEIGHT_DTYPES = ("int8",)
CALIBRATIONS = ("minmax", "percentile", "entropy")
MIN_BINS, MAX_BINS = 256, 1 << 20


class QuantizationError(ValueError):
    """A quantization input (scheme, module, calibration data, layer name) that cannot be used."""


def _supported(values) -> str:
    return ", ".join(repr(v) for v in values)


@dataclass(frozen=True)
class QuantScheme:
    """How :func:`tvm_spinn.quantize` quantizes a model.

    Parameters
    ----------
    activations : str
        Storage type of quantized activations: ``"int8"`` (default) or ``"uint8"``. The int8 MAC
        path takes 8-bit operands only: int4, int16 and float8 variants are refused.
    weights : str
        Storage type of quantized weights: ``"int8"`` (symmetric, zero point 0).
    per_channel : bool
        One weight scale per output channel (conv2d: axis 0 of OIHW; matmul: axis 1 of [K, N])
        instead of one per tensor.
    symmetric_activations : bool
        Symmetric activation ranges (zero point 0 for int8, 128 for uint8) instead of asymmetric.
    calibration : str
        How an activation's range is chosen from the calibration samples: ``"minmax"`` (observed
        extremes), ``"percentile"`` (the ``percentile``-th percentile, clipping outliers) or
        ``"entropy"`` (TensorRT-style: the clipping threshold that minimises the KL divergence
        between the histogram of ``|x|`` and its quantized version).
    percentile : float
        Percentile for ``calibration="percentile"``, in (50, 100].
    num_bins : int
        Histogram bins for ``"percentile"`` and ``"entropy"`` calibration (256 ... 2**20).
    activation_matmuls : bool
        Also quantize ``matmul(a, b)`` of two activations (attention scores / context).
    keep_fp32 : tuple of str
        Layer names (see :func:`tvm_spinn.quant.quantizable_layers`) left in float32.
    """

    activations: str = "int8"
    weights: str = "int8"
    per_channel: bool = True
    symmetric_activations: bool = False
    calibration: str = "minmax"
    percentile: float = 99.99
    num_bins: int = 2048
    activation_matmuls: bool = True
    keep_fp32: tuple[str, ...] = field(default=())

    def __post_init__(self):
        if self.activations not in ACTIVATION_DTYPES:
            raise QuantizationError(
                f"quantization scheme activations={self.activations!r} is not supported: the int8 "
                f"MAC path takes activations {_supported(ACTIVATION_DTYPES)}"
            )
        if self.weights not in WEIGHT_DTYPES:
            raise QuantizationError(
                f"quantization scheme weights={self.weights!r} is not supported: weights must be "
                f"{_supported(WEIGHT_DTYPES)} (symmetric)"
            )
        for name in ("per_channel", "symmetric_activations", "activation_matmuls"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise QuantizationError(f"QuantScheme.{name} must be True or False, got {value!r}")
        if self.calibration not in CALIBRATIONS:
            raise QuantizationError(
                f"QuantScheme.calibration={self.calibration!r} is not supported: use one of "
                f"{_supported(CALIBRATIONS)}"
            )
        p = self.percentile
        if isinstance(p, bool) or not isinstance(p, Real) or not (50.0 < float(p) <= 100.0):
            raise QuantizationError(f"QuantScheme.percentile must be a number in (50, 100], got {p!r}")
        object.__setattr__(self, "percentile", float(p))
        n = self.num_bins
        if isinstance(n, bool) or not isinstance(n, int) or not (MIN_BINS <= n <= MAX_BINS):
            raise QuantizationError(
                f"QuantScheme.num_bins must be an integer in [{MIN_BINS}, {MAX_BINS}], got {n!r}"
            )
        keep = self.keep_fp32
        if isinstance(keep, str):
            keep = (keep,)
        try:
            keep = tuple(keep)
        except TypeError:
            raise QuantizationError(
                f"QuantScheme.keep_fp32 must be a sequence of layer names, got {self.keep_fp32!r}"
            ) from None
        bad = [k for k in keep if not isinstance(k, str)]
        if bad:
            raise QuantizationError(f"QuantScheme.keep_fp32 must contain layer names (str), got {bad[0]!r}")
        object.__setattr__(self, "keep_fp32", tuple(dict.fromkeys(keep)))

    # -- string shorthand -------------------------------------------------------------------
    _FLAGS = {
        "per-channel": ("per_channel", True), "per_channel": ("per_channel", True),
        "per-tensor": ("per_channel", False), "per_tensor": ("per_channel", False),
        "symmetric": ("symmetric_activations", True), "asymmetric": ("symmetric_activations", False),
        "minmax": ("calibration", "minmax"), "percentile": ("calibration", "percentile"),
        "entropy": ("calibration", "entropy"),
    }

    @classmethod
    def parse(cls, text: str) -> QuantScheme:
        """A scheme from a shorthand string.

        Tokens are separated by commas, ``+`` or spaces: an activation type (``int8``,
        ``uint8``), ``per-channel`` / ``per-tensor``, ``symmetric`` / ``asymmetric``, a
        calibration (``minmax``, ``percentile``, ``entropy``) or ``field=value`` for any field
        (``percentile=99.9`` also selects percentile calibration; ``keep_fp32=a;b``).

        Raises
        ------
        QuantizationError
            For an unknown token, field or value; the message quotes ``text``.
        """
        if not isinstance(text, str) or not text.strip():
            raise QuantizationError(f"quantization scheme must be a non-empty string, got {text!r}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict = {}
        tokens = [t for t in text.replace("+", ",").replace(" ", ",").split(",") if t]
        try:
            for tok in tokens:
                low = tok.lower()
                if "=" in tok:
                    key, value = (s.strip() for s in tok.split("=", 1))
                    key = key.replace("-", "_")
                    if key not in fields:
                        raise QuantizationError(
                            f"unknown field {key!r}; fields are {_supported(fields)}"
                        )
                    kwargs[key] = cls._convert(key, value)
                    if key == "percentile":
                        kwargs.setdefault("calibration", "percentile")
                elif low in cls._FLAGS:
                    key, value = cls._FLAGS[low]
                    kwargs[key] = value
                elif low[:1] in "iuf" and any(c.isdigit() for c in low):  # a data type
                    kwargs["activations"] = low
                else:
                    raise QuantizationError(
                        f"unknown token {tok!r}; use {_supported(ACTIVATION_DTYPES)}, "
                        f"{_supported(cls._FLAGS)} or field=value"
                    )
            return cls(**kwargs)
        except QuantizationError as err:
            raise QuantizationError(f"quantization scheme {text!r}: {err}") from None

    @staticmethod
    def _convert(key: str, value: str):
        if key in ("per_channel", "symmetric_activations", "activation_matmuls"):
            table = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
            if value.lower() not in table:
                raise QuantizationError(f"{key} must be true or false, got {value!r}")
            return table[value.lower()]
        if key == "percentile":
            try:
                return float(value)
            except ValueError:
                raise QuantizationError(f"percentile must be a number, got {value!r}") from None
        if key == "num_bins":
            try:
                return int(value)
            except ValueError:
                raise QuantizationError(f"num_bins must be an integer, got {value!r}") from None
        if key == "keep_fp32":
            return tuple(v for v in value.split(";") if v)
        return value

    def to_dict(self) -> dict:
        """The scheme as plain JSON-like values."""
        out = dataclasses.asdict(self)
        out["keep_fp32"] = list(self.keep_fp32)
        return out


def as_scheme(scheme) -> QuantScheme:
    """``None`` -> default scheme, ``str`` -> :meth:`QuantScheme.parse`, a scheme -> itself."""
    if scheme is None:
        return QuantScheme()
    if isinstance(scheme, QuantScheme):
        return scheme
    if isinstance(scheme, str):
        return QuantScheme.parse(scheme)
    raise QuantizationError(
        f"scheme must be None, a QuantScheme or a string such as 'int8', got {type(scheme).__name__}"
    )
