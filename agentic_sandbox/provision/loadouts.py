"""Loadouts: declarative instance profiles in YAML, validated by pydantic.

A loadout says what an instance gets: resources, network policy, packages, files, commands,
environment, secret references, skills (for its A2A card), the task runner and run budgets
(defaults and ceilings for exec). `extends` names a parent; a child's scalars override, lists
are appended (packages de-duplicated), and maps merge (budgets per field).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from agentic_sandbox.provision.egress_rules import EgressConfig

BUILTIN_DIR = Path(__file__).with_name("loadouts")
NAME_RE = r"^[a-z0-9][a-z0-9-]{0,62}$"
PACKAGE_RE = re.compile(r"^[a-z0-9][a-z0-9+.-]{0,127}(=[A-Za-z0-9.+~:-]+)?$")
ENV_RE = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"
MAX_DEPTH = 8


class LoadoutError(Exception):
    """A loadout that cannot be used; the message names the file and the field. `field`, when
    known, is the dotted path of the field at fault (`resources.cpus`, `extends`)."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Resources(_Strict):
    cpus: int = Field(default=1, ge=1, le=64)
    memory_mib: int = Field(default=1024, ge=256, le=262144)
    disk_gib: int = Field(default=8, ge=2, le=4096)


class WriteFile(_Strict):
    path: str = Field(pattern=r"^/[^\x00]*$", max_length=4096)
    content: str = Field(max_length=1024 * 1024)
    permissions: str = Field(default="0644", pattern=r"^0[0-7]{3}$")
    owner: str = Field(default="root:root", pattern=r"^[a-z_][a-z0-9_-]*:[a-z_][a-z0-9_-]*$")

    @field_validator("path")
    @classmethod
    def _no_dotdot(cls, value: str) -> str:
        if "/../" in value + "/" or value.endswith("/"):
            raise ValueError("must be a normalized absolute file path")
        return value


class SecretRef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_.-]{0,127}$", description="secret name")
    env: str | None = Field(default=None, pattern=ENV_RE, description="variable name in the guest")


class Skill(_Strict):
    id: str = Field(pattern=r"^[a-z0-9][a-z0-9_.-]{0,63}$")
    name: str = Field(min_length=1, max_length=128)
    description: str = Field(min_length=1, max_length=2000)
    tags: list[str] = Field(default_factory=list, max_length=32)
    examples: list[str] = Field(default_factory=list, max_length=32)
    input_schema: dict[str, Any] | None = Field(
        default=None, description="JSON Schema a `data` part must satisfy"
    )
    runner: list[str] | None = Field(
        default=None, description="argv template for this skill ({text}, {data_json})"
    )

    @field_validator("input_schema")
    @classmethod
    def _schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        import jsonschema

        try:
            jsonschema.Draft202012Validator.check_schema(value)
        except jsonschema.SchemaError as exc:
            raise ValueError(f"not a valid JSON Schema: {exc.message}") from None
        return value


class TaskRunner(_Strict):
    argv: list[str] = Field(
        default_factory=lambda: ["bash", "-lc", "{text}"],
        min_length=1,
        description="argv template; {text} is the message text, {data_json} the data part",
    )
    user: str = Field(default="agent", pattern=r"^[a-z_][a-z0-9_-]{0,31}$")
    cwd: str | None = Field(default=None, pattern=r"^/")
    timeout_seconds: int = Field(default=3600, ge=1, le=7 * 86400)

    @field_validator("argv")
    @classmethod
    def _placeholders(cls, value: list[str]) -> list[str]:
        for arg in value:
            for name in re.findall(r"{([^}]*)}", arg):
                if name not in ("text", "data_json"):
                    raise ValueError(
                        f"unknown placeholder {{{name}}} (use {{text}} or {{data_json}})"
                    )
        return value


class BudgetValues(_Strict):
    """One set of run budget values; an unset field is no limit (as far as this set goes)."""

    timeout_seconds: float | None = Field(default=None, gt=0, le=7 * 86400)
    memory_mib: int | None = Field(default=None, ge=4, le=4 * 1024 * 1024)
    cpus: float | None = Field(default=None, ge=0.01, le=1024)
    pids: int | None = Field(default=None, ge=1, le=4_194_304)
    output_bytes: int | None = Field(default=None, ge=1, le=1024**4)


BUDGET_FIELDS = ("timeout_seconds", "memory_mib", "cpus", "pids", "output_bytes")
BUILTIN_MAX: dict[str, Any] = {"timeout_seconds": 86400}


class Budgets(_Strict):
    """Run budgets of an instance's execs: what a run gets when its request names none
    (`defaults`), and what no request may go past (`maxima`). A request may lower either;
    a field with a maximum but no default runs at the maximum. What a loadout leaves out keeps
    the built-in values (a 600 s default and a 1 day ceiling for the timeout; set a field to
    null to lift it)."""

    defaults: BudgetValues = BudgetValues(timeout_seconds=600)
    maxima: BudgetValues = BudgetValues(timeout_seconds=86400)

    @model_validator(mode="before")
    @classmethod
    def _over_builtin(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for part, builtin in (("defaults", {"timeout_seconds": 600}), ("maxima", BUILTIN_MAX)):
            given = out.get(part)
            if isinstance(given, dict):
                out[part] = {**builtin, **given}
        return out

    @model_validator(mode="after")
    def _defaults_within_maxima(self) -> Budgets:
        for name in BUDGET_FIELDS:
            default = getattr(self.defaults, name)
            ceiling = getattr(self.maxima, name)
            if default is not None and ceiling is not None and default > ceiling:
                raise ValueError(f"defaults.{name} ({default}) is above maxima.{name} ({ceiling})")
        return self

    def effective(self, name: str, asked: float | None) -> float | None:
        """The value a run gets for `name` when it asks for `asked` (None: nothing asked);
        raises ValueError when `asked` is above the ceiling."""
        ceiling = getattr(self.maxima, name)
        if asked is not None:
            if ceiling is not None and asked > ceiling:
                raise ValueError(f"at most {ceiling:g} (the loadout's ceiling)")
            return asked
        default = getattr(self.defaults, name)
        return default if default is not None else ceiling


class Loadout(_Strict):
    """A resolved loadout (after `extends`)."""

    name: str = Field(pattern=NAME_RE)
    description: str = ""
    resources: Resources = Resources()
    network: Literal["isolated", "allowlist", "nat"] = "isolated"
    egress: EgressConfig = Field(
        default=EgressConfig(),
        description="allowlist rules (HOST:PORT, *.SUFFIX:PORT …) and limits for `allowlist`",
    )
    sudo: bool = Field(default=False, description="passwordless sudo for the agent user")
    packages: list[str] = Field(default_factory=list, max_length=500)
    write_files: list[WriteFile] = Field(default_factory=list, max_length=200)
    runcmd: list[list[str]] = Field(default_factory=list, max_length=200)
    environment: dict[str, str] = Field(default_factory=dict)
    secrets: list[SecretRef] = Field(default_factory=list, max_length=100)
    skills: list[Skill] = Field(default_factory=list, max_length=100)
    task_runner: TaskRunner = TaskRunner()
    budgets: Budgets = Budgets()

    @field_validator("packages")
    @classmethod
    def _packages(cls, value: list[str]) -> list[str]:
        for p in value:
            if not PACKAGE_RE.match(p):
                raise ValueError(f"not a Debian package name: {p!r}")
        return value

    @field_validator("environment")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        for k in value:
            if not re.match(ENV_RE, k):
                raise ValueError(f"not an environment variable name: {k!r}")
        return value

    @model_validator(mode="after")
    def _unique(self) -> Loadout:
        ids = [s.id for s in self.skills]
        if len(ids) != len(set(ids)):
            raise ValueError("skills: ids must be unique")
        return self

    @property
    def needs_network_at_boot(self) -> bool:
        """Packages are fetched from the archive at first boot, which `isolated` forbids."""
        return bool(self.packages)

    def skill(self, skill_id: str) -> Skill | None:
        return next((s for s in self.skills if s.id == skill_id), None)


def _merge(parent: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    out = dict(parent)
    for key, value in child.items():
        if key in ("extends", "name"):
            continue
        if key == "packages":
            seen = list(dict.fromkeys([*out.get(key, []), *value]))
            out[key] = seen
        elif key in ("write_files", "runcmd", "secrets"):
            out[key] = [*out.get(key, []), *value]
        elif key == "skills":
            merged = {s["id"]: s for s in out.get(key, []) if isinstance(s, dict) and "id" in s}
            for s in value:
                if isinstance(s, dict) and "id" in s:
                    merged[s["id"]] = s
            out[key] = list(merged.values())
        elif key == "egress" and isinstance(value, dict):
            found_egress = out.get(key)
            parent_egress: dict[str, Any] = found_egress if isinstance(found_egress, dict) else {}
            merged_egress = {**parent_egress, **value}
            if "allow" in value and "allow" in parent_egress:
                merged_egress["allow"] = [*parent_egress["allow"], *value["allow"]]
            out[key] = merged_egress
        elif key in ("resources", "environment", "task_runner") and isinstance(value, dict):
            out[key] = {**out.get(key, {}), **value}
        elif key == "budgets" and isinstance(value, dict):
            found = out.get(key)
            parent_budgets: dict[str, Any] = found if isinstance(found, dict) else {}
            merged_budgets = dict(parent_budgets)
            for part, values in value.items():
                before = parent_budgets.get(part)
                if isinstance(values, dict) and isinstance(before, dict):
                    merged_budgets[part] = {**before, **values}
                else:
                    merged_budgets[part] = values
            out[key] = merged_budgets
        else:
            out[key] = value
    return out


def _format_error(where: str, exc: ValidationError) -> str:
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "(loadout)"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{where}: {loc}: {first['msg']}{more}"


class LoadoutCatalog:
    """Loadouts from the built-in folder plus any extra folders (later ones win by name)."""

    def __init__(self, folders: Iterable[Path] = (BUILTIN_DIR,)) -> None:
        self._raw: dict[str, tuple[dict[str, Any], str]] = {}
        for folder in folders:
            if not folder.is_dir():
                continue
            for f in sorted(folder.glob("*.yaml")):
                self.add_yaml(f.read_text(encoding="utf-8"), where=str(f), validate=False)
        for name in self._raw:  # validate once every parent is known
            self.resolve(name)

    def add_yaml(self, text: str, where: str = "<loadout>", *, validate: bool = True) -> str:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise LoadoutError(f"{where}: not valid YAML: {exc}") from None
        return self.add(data, where, validate=validate)

    def add(self, data: Any, where: str = "<loadout>", *, validate: bool = True) -> str:
        if not isinstance(data, dict):
            raise LoadoutError(f"{where}: a loadout is a mapping")
        name = data.get("name")
        if not isinstance(name, str) or not re.match(NAME_RE, name):
            raise LoadoutError(f"{where}: name: must match {NAME_RE}")
        previous = self._raw.get(name)
        self._raw[name] = (data, where)
        if validate:
            try:
                self.resolve(name)  # a bad loadout fails where it is added
            except LoadoutError:
                if previous is None:
                    del self._raw[name]
                else:
                    self._raw[name] = previous
                raise
        return name

    def copy(self) -> LoadoutCatalog:
        """A catalog with the same loadouts, to add one-off loadouts to without touching this."""
        other = LoadoutCatalog([])
        other._raw = dict(self._raw)
        return other

    def names(self) -> list[str]:
        return sorted(self._raw)

    def raw(self, name: str) -> dict[str, Any]:
        return dict(self._raw[name][0])

    def resolve(self, name: str) -> Loadout:
        chain: list[tuple[dict[str, Any], str]] = []
        current: str | None = name
        while current is not None:
            if current not in self._raw:
                if not chain:  # the name asked for, not a parent
                    known = ", ".join(self.names())
                    raise LoadoutError(f"unknown loadout {current!r} (known: {known})")
                raise LoadoutError(f"{chain[-1][1]}: extends: unknown loadout {current!r}")
            if any(c[0].get("name") == current for c in chain) or len(chain) > MAX_DEPTH:
                raise LoadoutError(
                    f"{self._raw[name][1]}: extends: cycle or too deep at {current!r}"
                )
            chain.append(self._raw[current])
            parent = chain[-1][0].get("extends")
            if parent is not None and not isinstance(parent, str):
                raise LoadoutError(f"{chain[-1][1]}: extends: must be a loadout name")
            current = parent
        merged: dict[str, Any] = {}
        for data, _ in reversed(chain):
            merged = _merge(merged, data)
        merged["name"] = name
        try:
            return Loadout.model_validate(merged)
        except ValidationError as exc:
            raise LoadoutError(_format_error(self._raw[name][1], exc)) from None


LIST_FIELDS = ("packages", "write_files", "runcmd", "secrets", "skills")
MAP_FIELDS = ("resources", "environment", "task_runner", "budgets")


def extend(parent: Loadout | None, child: dict[str, Any], name: str) -> Loadout:
    """`child` (a loadout document as its YAML would be) over an already resolved `parent`,
    with the same merge rules as the catalog's `extends`; named `name`. A problem is a
    `LoadoutError` whose `field` names the child's field."""
    for key in LIST_FIELDS:
        if key in child and not isinstance(child[key], list):
            raise LoadoutError(f"{key}: must be a list", field=key)
    for key in MAP_FIELDS:
        if key in child and not isinstance(child[key], dict):
            raise LoadoutError(f"{key}: must be a mapping", field=key)
    base = parent.model_dump(mode="json") if parent is not None else {}
    merged = _merge(base, child)
    merged["name"] = name
    try:
        return Loadout.model_validate(merged)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise LoadoutError(_format_error(name, exc), field=loc or None) from None


def load_catalog(extra: Iterable[Path] = ()) -> LoadoutCatalog:
    return LoadoutCatalog([BUILTIN_DIR, *extra])
