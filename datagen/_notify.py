"""The failure notification `datagen up` keeps on the Prefect server: one automation that fires when a
flow run of a `datagen` deployment ends Failed, Crashed or Cancelled, or says its goodput stayed low
(the ``datagen.goodput.low`` event of flows/fleet.py: the message names the biggest loss).

Where it goes: the notification block named by ``--notify`` / ``$DATAGEN_NOTIFY_BLOCK``
(``<block-type-slug>/<block-name>``, e.g. ``slack-webhook/datagen-alerts`` or
``sendgrid-email/oncall``). Without one, a new automation gets Prefect's "do nothing" action (its
firings still show on the Automations and Events pages), and an existing one keeps the actions it
has, so a notification action added in the UI survives the next `datagen up`. The automation is
found by name and updated in place: running `up` again never adds a second one.
"""

from __future__ import annotations

from typing import Any

import httpx

from datagen._prefect_api import PrefectApi
from tasks.errors import DatagenError

__all__ = ["AUTOMATION_NAME", "GOODPUT_LOW", "NOTIFY_ENV", "NotifyError", "ensure_failure_automation", "failure_automation"]

AUTOMATION_NAME = "datagen: run failed, crashed or cancelled"
NOTIFY_ENV = "DATAGEN_NOTIFY_BLOCK"
END_STATES = ("Failed", "Crashed", "Cancelled")
GOODPUT_LOW = "datagen.goodput.low"  # flows/fleet.py emits it for the flow run

SUBJECT = ("datagen {{ deployment.name }}: {{ flow_run.name }} "
           f"{{% if event.event == '{GOODPUT_LOW}' %}}goodput low{{% else %}}{{{{ flow_run.state.name }}}}{{% endif %}}")
BODY = f"""\
{{% if event.event == '{GOODPUT_LOW}' %}}\
Flow run {{{{ flow_run.name }}}} of deployment datagen/{{{{ deployment.name }}}} is running below its goodput \
threshold: {{{{ event.payload.message }}}}
{{% else %}}\
Flow run {{{{ flow_run.name }}}} of deployment datagen/{{{{ deployment.name }}}} entered {{{{ flow_run.state.name }}}}.
{{% endif %}}\
""" + """\
Parameters: {{ flow_run.parameters }}
Reason: {{ flow_run.state.message }}
Control host: {{ flow_run.labels.get('datagen.host', 'not reported') }}; at its last report: \
{{ flow_run.labels.get('datagen.progress', 'nothing committed') }}
Run: {{ flow_run|ui_url }}
Deployment (its runs, the one running first): {{ deployment|ui_url }}
"""


class NotifyError(DatagenError, ValueError):
    """The notification block given to `datagen up` is malformed or does not exist on the server."""


def _trigger() -> dict[str, Any]:
    # Every related resource spec must match (Prefect ANDs them): the flow is `datagen` and the
    # run belongs to a deployment, so ad-hoc `datagen run` invocations do not notify.
    return {
        "type": "event",
        "posture": "Reactive",
        "threshold": 1,
        "within": 0,
        "expect": [*(f"prefect.flow-run.{s}" for s in END_STATES), GOODPUT_LOW],
        "match": {"prefect.resource.id": "prefect.flow-run.*"},
        "match_related": [
            {"prefect.resource.role": "flow", "prefect.resource.name": "datagen"},
            {"prefect.resource.role": "deployment", "prefect.resource.id": "prefect.deployment.*"},
        ],
    }


def failure_automation(actions: list[dict[str, Any]]) -> dict[str, Any]:
    """The automation document (``POST /automations/`` body) with ``actions``."""
    return {
        "name": AUTOMATION_NAME,
        "description": "A datagen deployment run ended Failed, Crashed or Cancelled, or its goodput stayed low "
                       "(managed by `datagen up`; "
                       f"route it with `datagen up --notify <block-type>/<block-name>` or ${NOTIFY_ENV}).",
        "enabled": True,
        "trigger": _trigger(),
        "actions": actions,
        "actions_on_trigger": [],
        "actions_on_resolve": [],
    }


def _block_id(http: httpx.Client, spec: str) -> str:
    slug, sep, name = spec.partition("/")
    if not sep or not slug or not name:
        raise NotifyError(f"notification block {spec!r}: give <block-type-slug>/<block-name>, "
                          "e.g. slack-webhook/datagen-alerts")
    resp = http.get(f"/block_types/slug/{slug}/block_documents/name/{name}")
    if resp.status_code == 404:
        raise NotifyError(f"notification block {spec!r} not found on the Prefect server: create a "
                          f"{slug!r} block named {name!r} (UI: Blocks, +) and run `datagen up` again")
    resp.raise_for_status()
    return str(resp.json()["id"])


def ensure_failure_automation(api_url: str, block: str | None) -> dict[str, Any]:
    """Create or update the failure automation; returns ``{"id", "created", "actions"}``.

    Args:
        api_url: the Prefect API (``.../api``).
        block: ``<block-type-slug>/<block-name>`` to notify, or None to keep the existing actions
            (a new automation then does nothing but record its firings).

    Raises:
        NotifyError: ``block`` is malformed or absent.
        httpx.HTTPError: the API refused or did not answer.
    """
    with PrefectApi(api_url) as http:
        found = http.post("/automations/filter",
                          json={"automations": {"name": {"any_": [AUTOMATION_NAME]}}}).raise_for_status().json()
        existing = found[0] if found else None
        if block:
            actions = [{"type": "send-notification", "block_document_id": _block_id(http, block),
                        "subject": SUBJECT, "body": BODY}]
        elif existing is not None:
            actions = existing["actions"]
        else:
            actions = [{"type": "do-nothing"}]
        doc = failure_automation(actions)
        if existing is None:
            auto_id = str(http.post("/automations/", json=doc).raise_for_status().json()["id"])
        else:
            auto_id = str(existing["id"])
            http.put(f"/automations/{auto_id}", json=doc).raise_for_status()
    return {"id": auto_id, "created": existing is None, "actions": [a["type"] for a in actions]}
