"""What the family readers share: finding a config by model_type, and a positive number read with where
it came from."""

import math

from ..outcome import BadInput


def config_of(configs, kinds):
    """(config dict, where) of the first config whose model_type is one of `kinds`, else (None, None)."""
    return next(((raw, w) for raw, w in configs if raw.get("model_type") in kinds), (None, None))


def positive_number(raw, where, key, default, why):
    """(number > 0, provenance detail): the config's `key`, else `default` said to come from `why`."""
    value = raw.get(key)
    if value is None:
        return default, why
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise BadInput(where, key, f"must be a finite number > 0, got {value!r}")
    return float(value), f"{where}: {key}"
