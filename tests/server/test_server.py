"""The jupyter_server extension: ``GET <base_url>/oommagic/devices`` on a real Jupyter server.

Every test runs at the root and under a JupyterHub-style base URL. NVML is whatever this machine has
(none here, so the route must say so); no stand-in.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from jupyter_server.auth import Authorizer
from tornado.httpclient import HTTPClientError

import oommagic.server.handlers as handlers
from oommagic.devices import read_devices

pytest_plugins = ["pytest_jupyter.jupyter_server"]

DEVICE_KEYS = {"nvml_index", "cuda_index", "uuid", "name", "used", "total", "free", "processes", "error"}


@pytest.fixture
def jp_server_config():
    return {"ServerApp": {"jpserver_extensions": {"oommagic": True}}}


@pytest.fixture(params=["/", "/user/alice/"])
def jp_base_url(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def readings(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Counts the NVML readings the route makes (the real ``read_devices`` still answers)."""
    calls: list[float] = []

    def counted_read_devices():
        calls.append(1.0)
        return read_devices()

    monkeypatch.setattr(handlers, "read_devices", counted_read_devices)
    return calls


async def get_devices(jp_fetch) -> dict:
    response = await jp_fetch("oommagic", "devices")
    assert response.code == 200
    assert response.headers["Content-Type"].startswith("application/json")
    return json.loads(response.body)


async def test_devices_route_answers_the_documented_shape(jp_fetch) -> None:
    data = await get_devices(jp_fetch)
    assert set(data) == {"version", "time", "available", "error", "driver", "devices"}
    assert data["version"] == 1
    assert isinstance(data["time"], float) and data["time"] > 1.7e9
    assert isinstance(data["available"], bool)
    for device in data["devices"]:
        assert set(device) == DEVICE_KEYS
        for process in device["processes"]:
            assert set(process) == {"pid", "name", "used"}


async def test_devices_route_without_nvml_says_why(jp_fetch) -> None:
    if read_devices().available:
        pytest.skip("this machine has NVML")
    data = await get_devices(jp_fetch)
    assert data["available"] is False
    assert isinstance(data["error"], str) and data["error"]
    assert data["devices"] == []


@pytest.mark.parametrize("authorization", ["", "token not-the-token"])
async def test_request_without_a_valid_token_is_refused(jp_fetch, authorization: str) -> None:
    response = await jp_fetch(
        "oommagic",
        "devices",
        headers={"Authorization": authorization},
        raise_error=False,
        follow_redirects=False,
    )
    assert response.code in (302, 401, 403)
    assert b"devices" not in (response.body or b"")
    assert b"available" not in (response.body or b"")


async def test_route_lives_under_the_base_url(jp_fetch, jp_base_url, http_server_client, jp_auth_header):
    if jp_base_url == "/":
        pytest.skip("at the root the two paths are one")
    with pytest.raises(HTTPClientError) as refused:
        await http_server_client.fetch("/oommagic/devices", headers=jp_auth_header)
    assert refused.value.code == 404
    assert (await get_devices(jp_fetch))["version"] == 1


async def test_panels_polling_together_share_one_reading(jp_fetch, readings) -> None:
    answers = await asyncio.gather(*(get_devices(jp_fetch) for _ in range(5)))
    assert len(readings) == 1
    assert len({a["time"] for a in answers}) == 1


async def test_a_reading_older_than_max_age_is_renewed(jp_fetch, readings) -> None:
    first = await get_devices(jp_fetch)
    await asyncio.sleep(0.6)  # the default max_age is 0.5 s
    second = await get_devices(jp_fetch)
    assert len(readings) == 2
    assert second["time"] > first["time"]


class TestMaxAgeIsConfigurable:
    @pytest.fixture
    def jp_server_config(self):
        return {
            "ServerApp": {"jpserver_extensions": {"oommagic": True}},
            "OOMMagicDeviceCache": {"max_age": 0.0},
        }

    async def test_max_age_zero_reads_nvml_for_every_request(self, jp_fetch, readings) -> None:
        await get_devices(jp_fetch)
        await get_devices(jp_fetch)
        assert len(readings) == 2


class RefusesOOMMagic(Authorizer):
    """An operator's Authorizer that keeps this extension's resource from every user."""

    def is_authorized(self, handler, user, action, resource) -> bool:
        return resource != "oommagic"


class TestAuthorizerDecides:
    @pytest.fixture
    def jp_server_config(self):
        return {
            "ServerApp": {
                "jpserver_extensions": {"oommagic": True},
                "authorizer_class": RefusesOOMMagic,
            },
        }

    async def test_an_authorizer_can_refuse_the_route(self, jp_fetch) -> None:
        response = await jp_fetch("oommagic", "devices", raise_error=False)
        assert response.code == 403
        assert b"available" not in (response.body or b"")
