"""Hyperparameter checks: the one place the kernel (swapio.ops) and the optimizers (swapio.optim) validate them."""
import math
import numbers
from typing import Tuple

import torch


def scalar(name, value):
    """A Python float from a number or a one-element tensor (lr schedulers may hand either)."""
    if type(value) is float or type(value) is int:  # the common case, without the slow ABC checks below
        return float(value)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor, got shape {tuple(value.shape)}")
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def pair(name, value, entries):
    """The two entries of a hyperparameter pair (betas, eps) in order. A set or dict has no order (torch indexes
    the pair, and refuses them): which number would be which is not known."""
    if isinstance(value, (set, frozenset, dict)):
        raise TypeError(f"{name} must be an ordered pair {entries}, got a {type(value).__name__}")
    try:
        first, second = value
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a pair {entries}, got {value!r}") from None
    return first, second


STEP_LIMIT = 2**63 - 1  # the native steps take an int64


def check_step(step):
    if type(step) is int and 1 <= step <= STEP_LIMIT:
        return step
    if isinstance(step, torch.Tensor):
        if step.numel() != 1:
            raise ValueError(f"step must be a number or a one-element tensor, got shape {tuple(step.shape)}")
        step = step.item()
    if isinstance(step, bool) or not isinstance(step, numbers.Real):
        raise TypeError(f"step must be an int, got {type(step).__name__}")
    if not math.isfinite(step) or step != int(step):
        raise ValueError(f"step must be a whole number, got {step}")
    step = int(step)
    if step < 1:
        raise ValueError(f"step must be >= 1 (the step being taken, counting from 1), got {step}")
    if step > STEP_LIMIT:
        raise ValueError(f"step must be <= 2**63 - 1, got {step}")
    return step


def _finite_non_negative(name, value, what):
    value = scalar(name, value)
    if not (0.0 <= value < math.inf):
        raise ValueError(f"Invalid {what}: {value}")
    return value


def _betas(beta1, beta2, closed):
    """Each beta in [0, 1), or in [0, 1] when `closed` (Lion's)."""
    betas = scalar("beta1", beta1), scalar("beta2", beta2)
    for i, b in enumerate(betas):
        if not (0.0 <= b <= 1.0 if closed else 0.0 <= b < 1.0):
            raise ValueError(f"Invalid beta parameter at index {i}: {b}")
    return betas


def check_adam_hyper(lr, beta1, beta2, eps, weight_decay) -> Tuple[float, float, float, float, float]:
    """Adam's hyperparameters as Python floats, checked in torch's order with its messages (ValueError), or
    TypeError for a value that is not a real number."""
    lr = _finite_non_negative("lr", lr, "learning rate")
    eps = _finite_non_negative("eps", eps, "epsilon value")
    beta1, beta2 = _betas(beta1, beta2, closed=False)
    weight_decay = _finite_non_negative("weight_decay", weight_decay, "weight_decay value")
    return lr, beta1, beta2, eps, weight_decay


def check_lion_hyper(lr, beta1, beta2, weight_decay) -> Tuple[float, float, float, float]:
    """Lion's hyperparameters as Python floats (betas may reach 1); ValueError or TypeError when one is bad."""
    lr = _finite_non_negative("lr", lr, "learning rate")
    beta1, beta2 = _betas(beta1, beta2, closed=True)
    weight_decay = _finite_non_negative("weight_decay", weight_decay, "weight_decay value")
    return lr, beta1, beta2, weight_decay


def _at_least(name, value, low, says, infinite=False):
    """value as a float if low <= value (< inf unless `infinite`), else ValueError: torch's message (`says` the
    rule), and where the value is infinite, that it must be finite (torch takes inf, but for eps1, eps2 and
    weight_decay it only makes the parameters inf or NaN)."""
    value = scalar(name, value)
    if not (low <= value <= math.inf if infinite else low <= value < math.inf):
        raise ValueError(f"{says}{' and finite' if value == math.inf else ''} but is: {value}")
    return value


def check_adafactor_hyper(lr, beta2_decay, eps, d, weight_decay):
    """Adafactor's hyperparameters as torch.optim.Adafactor checks them (its messages, ValueError): returns
    (lr, beta2_decay, eps1, eps2, d, weight_decay) as Python floats, eps1 None where eps[0] is None (machine
    epsilon of float32, the dtype the step computes in)."""
    lr = _at_least("lr", lr, 0.0, "Learning rate should be >= 0", infinite=True)  # inf: rho = 1/sqrt(t) uncapped
    beta2_decay = scalar("beta2_decay", beta2_decay)
    if not beta2_decay <= 0.0:
        raise ValueError(f"beta2_decay should be <= 0 but is: {beta2_decay}")
    eps1, eps2 = pair("eps", eps, "(eps1 or None, eps2)")
    if eps1 is not None:
        eps1 = _at_least("eps1", eps1, 0.0, "epsilon1 should be >= 0")
    eps2 = _at_least("eps2", eps2, 0.0, "epsilon2 should be >= 0")
    d = _at_least("d", d, 1.0, "Clipping threshold d should be >= 1", infinite=True)  # inf: no update clipping
    weight_decay = _at_least("weight_decay", weight_decay, 0.0, "weight_decay should be >= 0")
    return lr, beta2_decay, eps1, eps2, d, weight_decay
