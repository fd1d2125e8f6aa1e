"""app/cluster.py: what a new machine needs before the local cluster's first node starts."""

from __future__ import annotations

from app import cluster


def test_a_new_machine_gets_a_ray_token_and_an_existing_one_is_kept(tmp_path, monkeypatch):
    """Under token auth `ray start --head` refuses to start without a token, and only ray.init makes one."""
    for var in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    home = {"HOME": str(tmp_path)}
    token = tmp_path / ".ray" / "auth_token"
    assert not token.exists()
    cluster.ensure_auth_token(home)
    first = token.read_text()
    assert len(first.strip()) >= 32
    cluster.ensure_auth_token(home)
    assert token.read_text() == first  # running nodes hold the old one
