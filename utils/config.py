"""Typed run configuration: parsed from config.yaml once, validated, then read as attributes.

Key names follow the authors' repository (num_outer_steps, lr_inner, ETA, vartheta, ...), so their
users feel at home. Precedence: command-line `key=value` overrides > YAML file > defaults.
One concern per module: the keys (`utils/config_schema.py`: every field carries a `doc` and marks saying what
the key is, see `_f`), the cross-key rules and warnings (`utils/config_rules.py`), the generic typed-YAML loader
(`utils/typed_yaml.py`), the docs table (`utils/config_docs.py`: `python -m utils.config --markdown` prints it,
`--update-docs` rewrites docs/configuration.md) and reading a run directory's config in today's meaning
(`run_dir/run_config.py`). This face adds the checks and the hash that decides whether a checkpoint resumes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from utils.config_docs import TABLE_END, TABLE_START, markdown_table, update_docs
from utils.config_rules import CONFIG_WARNINGS, SECTION_CHECKS
from utils.config_schema import (
    ADAPTIVE_TESTS,
    ADDED_LATER,
    CLUSTER_KEYS,
    FAULT_KINDS,
    MAX_NAME_BYTES,
    PER_MACHINE_KEYS,
    RESUME_MAY_CHANGE,
    RUN_DIR_ENTRIES,
    WHERE_KEYS,
    ConfigFields,
    DeviceSpec,
    ModelConfig,
    documented,
    keys_where,
)
from utils.typed_yaml import load_typed, parse_overrides

__all__ = ["ADAPTIVE_TESTS", "ADDED_LATER", "CLUSTER_KEYS", "FAULT_KINDS", "HASH_DEFAULTS", "MAX_NAME_BYTES",
           "PER_MACHINE_KEYS", "RESUME_MAY_CHANGE", "RUN_DIR_ENTRIES", "TABLE_END", "TABLE_START", "WHERE_KEYS",
           "Config", "DeviceSpec", "ModelConfig", "documented", "keys_where", "load_config", "markdown_table",
           "parse_overrides", "update_docs"]

# Keys whose default changed after checkpoints were written: the config hash leaves them out at the value those
# versions ran (and wrote no hash entry for), so those checkpoints stay resumable and today's default, which
# computes something else, gets a hash of its own. statistics_comm: fp64 until 2026-11-25, then minimal.
HASH_DEFAULTS = {"statistics_comm": "fp64"}


class Config(ConfigFields):
    """A run's configuration: the keys of ConfigFields, checked across keys when made (and on every replace)."""

    def __post_init__(self) -> None:
        for check in SECTION_CHECKS.values():  # the cross-key checks, one function per section (below)
            check(self)

    def warnings(self) -> list[str]:
        """Valid settings that likely do not do what the user wants; run.py logs them before any work."""
        return [warning for check in CONFIG_WARNINGS for warning in check(self)]

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def meaning(self, legacy: bool = False) -> dict[str, Any]:
        """The settings that decide a run's numbers: every key but those marked resume (max_tokens does
        decide linear_rampup's schedule when rampup_tokens is 0, so that schedule length counts too).
        legacy: as versions before 2026-11-24 computed it, counting a list-valued key marked added_later
        (node_schedule) even at its default."""
        fields = {f.name: f for f in dataclasses.fields(self)}

        def at_default(f: dataclasses.Field, value: Any) -> bool:
            if f.default_factory is not dataclasses.MISSING:
                return not legacy and value == f.default_factory()
            return value == HASH_DEFAULTS.get(f.name, f.default)

        # keys added after checkpoints were written count only when set: those checkpoints stay resumable
        meaning = {k: v for k, v in self.to_dict().items() if not fields[k].metadata["resume"]
                   and not (fields[k].metadata["added_later"] and at_default(fields[k], v))}
        if self.sampling_method == "linear_rampup":
            meaning["rampup_tokens"] = self.rampup_tokens or self.max_tokens
        if self.streams:  # fragment_alpha's meaning changed on 2026-11-24: no older streaming checkpoint matches
            meaning["fragment_alpha_weighs"] = self.fragment_alpha_weighs
        return meaning

    def meaning_hash(self, legacy: bool = False) -> str:
        """A checkpoint is resumable under a config with the same hash."""
        return hashlib.sha256(json.dumps(self.meaning(legacy), sort_keys=True).encode()).hexdigest()[:16]

    def meaning_hashes(self) -> tuple[str, ...]:
        """The hashes a resumable checkpoint of this config may carry: today's, then the one versions before
        2026-11-24 wrote (which counted node_schedule at its default: their checkpoints stay resumable)."""
        return tuple(dict.fromkeys((self.meaning_hash(), self.meaning_hash(legacy=True))))


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, schema: type | None = None,
                section: str | None = None) -> Any:
    """Read a YAML file (optional), apply `key=value` overrides, validate everything into `schema` (default Config).

    section: a top-level key whose mapping holds the settings, when present (the authors' gradient
    tool nests them under script_settings)."""
    return load_typed(schema or Config, path, overrides, section)


if __name__ == "__main__":
    if "--markdown" in sys.argv:
        print(markdown_table())
    if "--update-docs" in sys.argv:
        update_docs()
