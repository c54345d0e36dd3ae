"""The Airflow REST API, as the tunix tasks use it: `apache-airflow-client` + `tenacity`.

`AirflowApiClient.from_environment()` finds the API server and its credentials (first
match wins), in the task process:

1. an Airflow connection `tunix_airflow_api` (e.g. env
   `AIRFLOW_CONN_TUNIX_AIRFLOW_API='http://user:password@airflow-api:8080'`,
   or a connection whose `password` field holds a ready JWT and `extra` `{"token": true}`);
2. env `TUNIX_AIRFLOW_API_URL` (+ `TUNIX_AIRFLOW_API_TOKEN`, or
   `TUNIX_AIRFLOW_API_USER` / `TUNIX_AIRFLOW_API_PASSWORD` exchanged at `/auth/token`);
3. Airflow config `[api] base_url`, else `[core] execution_api_server_url` without its
   `/execution/` suffix. Credentials there come from the simple auth manager of a local
   Airflow (`airflow standalone`): its first configured user and the password Airflow
   generated into `simple_auth_manager_passwords.json.generated` (read, never logged);
   none when it runs with `AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS=True`.

Every call is retried by tenacity on connection errors, 429 and 5xx (and once after a
401 when a password login can fetch a fresh token); what still fails raises
`AirflowApiError`. The client package is imported on first use, never at DAG parse time.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger(__name__)

API_CONN_ID = "tunix_airflow_api"
RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
T = TypeVar("T")


class AirflowApiError(RuntimeError):
    """The Airflow REST API refused a request (or could not be reached)."""


class AirflowApiClient:
    """The few `/api/v2` calls tunix makes, through the maintained Airflow client."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        username: str | None = None,
        password: str | None = None,
        timeout_s: float = 10.0,
        attempts: int = 3,
        wait_s: float = 2.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.username = username
        self.password = password
        self.timeout_s = timeout_s
        self.attempts = attempts
        self.wait_s = wait_s
        self._api: Any = None
        self._asset_ids: dict[str, int] = {}

    @classmethod
    def from_environment(cls, **kwargs: Any) -> AirflowApiClient:
        """Build a client from the connection / env vars / Airflow config (module docstring)."""
        conn = _from_connection(**kwargs)
        if conn is not None:
            return conn
        url = os.environ.get("TUNIX_AIRFLOW_API_URL")
        if url:
            return cls(
                url,
                token=os.environ.get("TUNIX_AIRFLOW_API_TOKEN") or None,
                username=os.environ.get("TUNIX_AIRFLOW_API_USER") or None,
                password=os.environ.get("TUNIX_AIRFLOW_API_PASSWORD") or None,
                **kwargs,
            )
        return cls(_url_from_airflow_config(), **{**_simple_auth_login(), **kwargs})

    # -- plumbing
    def _api_client(self):
        """An `airflow_client.client.ApiClient` with a bearer token (logging in if needed)."""
        if self._api is None:
            from airflow_client.client import ApiClient, Configuration

            if self.token is None and self.username and self.password:
                self.token = self._login()
            config = Configuration(host=self.base_url, access_token=self.token)
            config.retries = False  # tenacity retries, urllib3 doesn't
            self._api = ApiClient(config)
        return self._api

    def _login(self) -> str:
        """`POST /auth/token` (simple auth manager / FAB): credentials -> JWT."""
        from airflow_client.client import ApiClient, Configuration

        api = ApiClient(Configuration(host=self.base_url))
        request = api.param_serialize(
            "POST",
            "/auth/token",
            header_params={"Content-Type": "application/json", "Accept": "application/json"},
            body={"username": self.username, "password": self.password},
        )
        response = api.call_api(*request, _request_timeout=self.timeout_s)
        response.read()
        out = api.response_deserialize(response, {"200": "object", "201": "object"}).data
        return out["access_token"]

    def _retryable(self, err: BaseException) -> bool:
        import urllib3
        from airflow_client.client.exceptions import ApiException

        if isinstance(err, ApiException):
            if err.status == 401 and self.username and self.password:
                self.token, self._api = None, None  # expired JWT: log in again
                return True
            return err.status in RETRY_STATUS
        return isinstance(err, urllib3.exceptions.HTTPError | OSError)

    def call(self, what: str, fn: Callable[[Any], T]) -> T:
        """`fn(ApiClient)` with retries; failures raise `AirflowApiError` naming `what`."""
        import tenacity
        import urllib3
        from airflow_client.client.exceptions import ApiException

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.attempts),
            wait=tenacity.wait_exponential(multiplier=self.wait_s, max=30),
            retry=tenacity.retry_if_exception(self._retryable),
            before_sleep=lambda state: log.warning(
                "%s: attempt %d failed (%s); retrying",
                what,
                state.attempt_number,
                state.outcome.exception() if state.outcome else None,
            ),
            reraise=True,
        )
        try:
            return retrying(lambda: fn(self._api_client()))
        except ApiException as err:
            detail = (err.body or err.reason or "")[:500]
            raise AirflowApiError(f"{what}: HTTP {err.status}: {detail}") from None
        except (urllib3.exceptions.HTTPError, OSError) as err:
            raise AirflowApiError(f"{what}: {self.base_url}: {err}") from None

    # -- API
    def asset_id(self, name: str) -> int:
        """The database id of the asset named `name` (exists once a DAG using it is parsed)."""
        if name not in self._asset_ids:
            from airflow_client.client import AssetApi

            out = self.call(
                f"GET /api/v2/assets?name_pattern={name}",
                lambda api: AssetApi(api).get_assets(
                    name_pattern=name, limit=100, _request_timeout=self.timeout_s
                ),
            )
            ids = [a.id for a in out.assets if a.name == name]
            if not ids:
                raise AirflowApiError(
                    f"asset {name!r} is not registered: is a DAG that uses it (tunix_eval) parsed?"
                )
            self._asset_ids[name] = int(ids[0])
        return self._asset_ids[name]

    def pool_names(self) -> set[str]:
        """`GET /api/v2/pools`: the names of the pools that exist."""
        from airflow_client.client import PoolApi

        names: set[str] = set()
        while True:
            page = self.call(
                "GET /api/v2/pools",
                lambda api, offset=len(names): PoolApi(api).get_pools(
                    limit=100, offset=offset, _request_timeout=self.timeout_s
                ),
            )
            names.update(pool.name for pool in page.pools)
            if not page.pools or len(names) >= (page.total_entries or 0):
                return names

    def post_asset_event(self, name: str, extra: dict[str, Any]) -> dict[str, Any]:
        """`POST /api/v2/assets/events`: record that the asset `name` was updated."""
        from airflow_client.client import AssetApi, CreateAssetEventsBody

        body = CreateAssetEventsBody(asset_id=self.asset_id(name), extra=extra)
        event = self.call(
            "POST /api/v2/assets/events",
            lambda api: AssetApi(api).create_asset_event(body, _request_timeout=self.timeout_s),
        )
        return json.loads(event.to_json())


def _from_connection(**kwargs: Any) -> AirflowApiClient | None:
    try:
        from airflow.sdk import BaseHook

        conn = BaseHook.get_connection(API_CONN_ID)
    except Exception:  # not defined (AirflowNotFoundException) or no Airflow context
        return None
    scheme = conn.schema or "http"
    if conn.conn_type in ("http", "https"):
        scheme = conn.conn_type
    url = f"{scheme}://{conn.host}" + (f":{conn.port}" if conn.port else "")
    extra = conn.extra_dejson or {}
    if extra.get("token"):
        return AirflowApiClient(url, token=conn.password, **kwargs)
    return AirflowApiClient(
        url, username=conn.login or None, password=conn.password or None, **kwargs
    )


def _url_from_airflow_config() -> str:
    from airflow.configuration import conf

    base = conf.get("api", "base_url", fallback="") or ""
    if base.startswith("http"):
        return base.rstrip("/")
    execution = conf.get("core", "execution_api_server_url", fallback="") or ""
    if execution.startswith("http"):
        return execution.rstrip("/").removesuffix("/execution")
    port = conf.get("api", "port", fallback="8080")
    return f"http://localhost:{port}"


def _simple_auth_login() -> dict[str, str]:
    """`{"username", "password"}` of a local SimpleAuthManager (`airflow standalone`): the
    first user of `[core] simple_auth_manager_users` that has a generated password. Empty
    for another auth manager, with all-admins, or when the file is not on this host."""
    from airflow.configuration import conf

    manager = conf.get("core", "auth_manager", fallback="") or ""
    if not manager.endswith("SimpleAuthManager") or conf.getboolean(
        "core", "simple_auth_manager_all_admins", fallback=False
    ):
        return {}
    from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager

    try:
        with open(SimpleAuthManager.get_generated_password_file()) as f:
            passwords = json.load(f)
        users = [u.split(":")[0] for u in conf.getlist("core", "simple_auth_manager_users")]
    except (OSError, ValueError):
        return {}
    for user in users:
        if isinstance(passwords, dict) and passwords.get(user):
            return {"username": user, "password": str(passwords[user])}
    return {}
