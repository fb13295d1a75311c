"""Joining a cluster by address uses the token Ray saved for it (Ray 2.60 turns token authentication on by
default, but takes the token for an explicit address only in token mode). Each case runs in a fresh Python:
the rule sets process-wide Ray state."""

import os
import subprocess
import sys

import pytest

SHOW_MODE = ("import os; from kvloom.cluster.ray_auth import use_token_for_address; "
             "use_token_for_address({address!r}); print(os.environ.get('RAY_AUTH_MODE'))")


def auth_mode_after(address, home, **env) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    done = subprocess.run([sys.executable, "-c", SHOW_MODE.format(address=address)], capture_output=True, text=True,
                          env={**clean, "HOME": str(home), **env}, timeout=120, check=True)
    return done.stdout.strip()


@pytest.fixture
def home_with_token(tmp_path):
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("0" * 32)
    return tmp_path


def test_an_explicit_address_with_a_saved_token_asks_for_token_mode(home_with_token):
    assert auth_mode_after("192.0.2.2:6379", home_with_token) == "token"


def test_a_cluster_found_locally_is_left_to_ray(home_with_token):
    assert auth_mode_after(None, home_with_token) == "None"
    assert auth_mode_after("auto", home_with_token) == "None"


def test_a_mode_the_user_chose_stays(home_with_token):
    assert auth_mode_after("192.0.2.2:6379", home_with_token, RAY_AUTH_MODE="disabled") == "disabled"


def test_without_a_token_nothing_changes(tmp_path):
    assert auth_mode_after("192.0.2.2:6379", tmp_path) == "None"
    assert auth_mode_after("192.0.2.2:6379", tmp_path, RAY_AUTH_TOKEN="x" * 32) == "token"
