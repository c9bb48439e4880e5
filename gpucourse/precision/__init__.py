"""Chapter 06 — mixed precision: number formats, autocast, dynamic loss scaling, measured speed.

- ``number_formats``  fp32 / fp16 / bf16 from their bits: range, precision, underflow
- ``format_plots``    their ranges and a tensor's values on a log2 scale, drawn
- ``loss_scaling``    ``LossScaler``: dynamic loss scaling, the algorithm behind ``GradScaler``
- ``amp``             ``torch.autocast`` + a scaler: which op runs in which dtype, one AMP step
- ``amp_speed``       where bf16 is fast and where it is not, op by op
"""

from .amp import AmpStepResult, AutocastModule, OpRecord, amp_step, autocast_op_dtypes, format_op_table
from .amp_speed import (ElementwiseNet, OpTimes, PrecisionRun, compare_precisions, explain_bf16_speedup,
                        op_time_shares, plot_time_split, training_step)
from .loss_scaling import LossScaler, activation_gradients, update_scale
from .format_plots import plot_log2_histogram, plot_ranges
from .number_formats import (BitFields, CastReport, FloatFormat, bit_fields, cast_report, float_format,
                             format_table, lost_update_fraction, underflow_fraction)

__all__ = ["AmpStepResult", "AutocastModule", "OpRecord", "amp_step", "autocast_op_dtypes",
           "format_op_table", "ElementwiseNet", "OpTimes", "PrecisionRun", "compare_precisions",
           "explain_bf16_speedup", "op_time_shares", "plot_time_split", "training_step", "LossScaler",
           "activation_gradients",
           "update_scale", "BitFields", "CastReport", "FloatFormat", "bit_fields", "cast_report",
           "float_format", "format_table", "lost_update_fraction", "plot_log2_histogram", "plot_ranges",
           "underflow_fraction"]
