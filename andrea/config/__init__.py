"""Typed configuration: YAML sections `model`, `data`, `train` loaded into dataclasses.

`sections` declares every key once (type, default, allowed values, resume rule, description),
`declare` is how a key is declared, `load` reads and validates configs against the declarations,
`reference` prints them (`andrea config keys`, docs/config.md).
"""

from andrea.config.declare import KeySpec, Registered, register_choices
from andrea.config.load import (
    config_from_dict,
    from_dict,
    load_config,
    load_run_config,
    override_value,
    parse_override,
    resolve_path,
    validate,
    value_text,
)
from andrea.config.sections import (
    PRECISION_DTYPES,
    PRECISIONS,
    SECTIONS,
    Config,
    DataConfig,
    ModelConfig,
    TrainConfig,
    key_spec,
    key_specs,
    registered_keys,
)

__all__ = [
    "PRECISION_DTYPES", "PRECISIONS", "SECTIONS", "Config", "DataConfig", "KeySpec",
    "ModelConfig", "Registered", "TrainConfig", "register_choices",
    "config_from_dict", "from_dict", "key_spec", "key_specs", "load_config", "load_run_config",
    "override_value", "parse_override", "registered_keys", "resolve_path", "validate",
    "value_text",
]
