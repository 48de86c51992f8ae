"""The content address of a loadout version: SHA-256 over RFC 8785 canonical JSON of the
document (the spec as saved and the parent version `extends` was pinned to)."""

from __future__ import annotations

import hashlib
import json

import pytest

from agentic_sandbox.broker.instances.loadouts import canonical_digest, version_document


def test_equal_content_has_one_digest_whatever_the_spelling() -> None:
    a = version_document({"name": "w", "resources": {"cpus": 2, "memory_mib": 1024}}, None)
    b = json.loads(
        '{"extends_version": null, "spec": {"resources": '
        '{"memory_mib": 1024.0, "cpus": 2}, "name": "w"}}'
    )
    assert canonical_digest(a) == canonical_digest(b)
    canonical = (
        b'{"extends_version":null,"spec":{"name":"w","resources":{"cpus":2,"memory_mib":1024}}}'
    )
    assert canonical_digest(a) == hashlib.sha256(canonical).hexdigest()


def test_any_change_of_content_or_of_the_pinned_parent_is_another_digest() -> None:
    spec = {"name": "w", "extends": "minimal", "packages": ["git"]}
    base = canonical_digest(version_document(spec, 1))
    assert canonical_digest(version_document(spec, 2)) != base  # the parent moved on
    assert canonical_digest(version_document({**spec, "packages": ["git", "jq"]}, 1)) != base
    assert canonical_digest(version_document({**spec, "packages": ["jq", "git"]}, 1)) != base
    assert canonical_digest(version_document({**spec, "description": ""}, 1)) != base
    assert len(base) == 64 and int(base, 16) >= 0


def test_what_json_cannot_hold_canonically_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        canonical_digest({"spec": {"n": 2**60}})
    with pytest.raises(ValueError):
        canonical_digest({"spec": {"n": float("nan")}})
