"""Run configuration: the schema, reading TOML and overrides, and validation.

``from boostlr.config import RunConfig, build_config`` is the usual entry; the parts live in
:mod:`~boostlr.config.schema`, :mod:`~boostlr.config.parse`,
:mod:`~boostlr.config.validate` and :mod:`~boostlr.config.resolve` (the trainer's config,
resolved from the data and frozen).
"""

from boostlr.config.parse import (  # noqa: F401
    REMOVED_KEYS,
    apply_mapping,
    build_config,
    dump_toml,
    from_dict,
    load_toml,
    model_config_from_dict,
    parse_overrides,
    set_value,
    to_dict,
)
from boostlr.config.resolve import (  # noqa: F401
    DataFacts,
    freeze,
    is_resolved,
    resolve,
    thaw,
)
from boostlr.config.schema import (  # noqa: F401
    ACT_CKPT_MODES,
    ARCHS,
    DEVICES,
    DP_MODES,
    DTYPES,
    LAX_GATES,
    LOWRANK_ARCHS,
    MLP_FORMS,
    NORM_MODES,
    PP_SCHEDULES,
    PRESETS,
    SECTIONS,
    TP_STRATEGIES,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    Preset,
    RunConfig,
    TrainConfig,
)
from boostlr.config.validate import (  # noqa: F401
    launcher_world_size,
    profile_range,
    resolve_layout,
    resolve_model,
    resolve_vocab_dp,
    validate,
    validate_model,
    validate_parallel,
    validate_pipeline,
    vocab_dp_rule,
    vocab_over_dp,
)
