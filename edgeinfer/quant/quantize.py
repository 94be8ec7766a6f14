"""``quantize_checkpoint``: the whole ``edgeinfer quantize`` run, from a full-precision folder
to a compressed-tensors one (:mod:`.compress` quantizes and writes, :mod:`.awq` moves
activation outliers into the weights first when asked)."""

from __future__ import annotations

import json

from edgeinfer.progress import NoSteps, Steps
from edgeinfer.quant.awq import smooth_model
from edgeinfer.quant.compress import (
    REPORT_NAME,
    Method,
    QuantizeOptions,
    QuantizeReport,
    attach_quantization,
    check_group_size,
    check_out,
    language_linears,
    load_model,
    untie_lm_head,
    write_checkpoint,
)


def quantize_checkpoint(options: QuantizeOptions, steps: Steps | None = None) -> QuantizeReport:
    """Quantize ``options.model`` into ``options.out``; returns (and writes beside it) the report."""
    steps = steps or NoSteps()
    check_out(options.out, options.force)
    model = load_model(options.model, options.dtype)
    linears = language_linears(model)
    check_group_size(linears, options.spec)
    smoothing: dict[str, tuple[float, float]] = {}
    if options.method is Method.awq:
        smoothing = smooth_model(model, options, steps)
    if options.spec.lm_head_bits is not None:
        untie_lm_head(model)
    layers = attach_quantization(model, linears, options.spec, smoothing, steps)
    write_checkpoint(model, options)
    report = QuantizeReport(str(options.model), str(options.out), options.method.value, options.spec.bits,
                            options.spec.group_size, options.spec.symmetric,
                            str(options.calibration) if options.calibration else None,
                            options.samples if options.method is Method.awq else 0, layers,
                            str(next(model.parameters()).dtype).removeprefix("torch."))
    (options.out / REPORT_NAME).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return report
