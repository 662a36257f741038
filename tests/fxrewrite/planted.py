"""A deliberately wrong rule, planted among the defaults by the verify and bisect tests."""

from __future__ import annotations

import torch

import fxrewrite.runtime.ops  # noqa: F401  (torch.ops.fxr.*)
from fxrewrite import Rule
from fxrewrite.rewrites import norm


def eps_off_replacement(x, weight, eps):
    return torch.ops.fxr.rms_norm(x, weight, eps * 100)


# RMSNorm -> fxr.rms_norm with eps 100x off (wrong)
EPS_OFF = Rule("eps_off_rms_norm", norm.rms_norm_pattern, eps_off_replacement, norm.norm_guard, norm.WILDCARDS)
