"""The OpenAPI 3.1 description of the admin HTTP API (:mod:`mtaq.admin.http`), written by hand.

It is served at ``GET /openapi.json`` and kept as ``docs/admin_api.openapi.json``; a test checks that every
route of the application is described here and every path here is a route, and that the docs file equals
this document. Regenerate the file with ``python -m mtaq.admin.openapi > docs/admin_api.openapi.json``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

__all__ = ["SPEC", "dumps"]


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json_content(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": _json_content(_ref("Error"))}


_ERRORS = {
    "400": _error("Bad input; the message names the parameter"),
    "401": _error("Missing or wrong bearer token (admin_token, or the generated SPOOL/admin.token)"),
    "503": _error("Recovery in progress (Retry-After: 1), or admin_connections_max connections open (closed at once)"),
}
_NOT_FOUND = _error("No such queue, queue ID or action")


def _q(name: str, description: str, schema: dict[str, Any], *, required: bool = False) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": required, "description": description, "schema": schema}


def _p(name: str, description: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "description": description, "schema": {"type": "string"}}


_STR = {"type": "string"}
_BOOL = {"type": "boolean"}
_FILTERS = [
    _q("sender", "Case-insensitive substring of the envelope sender", _STR),
    _q("recipient", "Case-insensitive substring of a recipient address", _STR),
    _q("domain", "A recipient domain (after the last @), exact", _STR),
    _q("held", "Only held messages", _BOOL),
    _q("deferred", "Only deferred messages (waiting for a retry)", _BOOL),
    _q("olderThan", "Arrived more than this long ago: seconds, or 30m, 2h, 1d, 1w", _STR),
]
_QUEUE = _p("name", "The queue name: always 'spool' (mtaq has one queue; states are filters)")

SPEC: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {
        "title": "mtaq admin API",
        "version": "1",
        "description": (
            "Operate the queue of a running mtaq daemon; modelled on Apache James WebAdmin's mail-queue "
            "routes. One queue, named 'spool'. Every action is a durable record in the queue log and acts "
            "on a view of the queue consistent as of one log position, which the response names. A message "
            "under a delivery attempt (active) is skipped, never half-acted on. Times are UTC seconds since "
            "the epoch, sizes bytes. With several worker processes (workers > 1, or auto on several cores) "
            "every answer covers every spool shard: sizes summed, listings merged in the same order, an "
            "action on queue IDs done by the shard each ID names (its low 4 bits), an action on all mail or "
            "on filters done in every shard, /metrics summed; a position is then SHARD/SEGMENT:OFFSET of "
            "each shard, space-separated (each shard is consistent as of its own log position)."
        ),
    },
    "servers": [{"url": "http://127.0.0.1:2580"}],
    "security": [{"bearer": []}],
    "paths": {
        "/mailQueues": {
            "get": {
                "summary": "List the mail queues",
                "operationId": "listQueues",
                "responses": {
                    "200": {"description": "Queue names", "content": _json_content({"type": "array", "items": _STR})},
                    "401": _ERRORS["401"],
                },
            }
        },
        "/mailQueues/{name}": {
            "get": {
                "summary": "Size of the queue by state, from the daemon's counters (no scan)",
                "operationId": "getQueueSize",
                "parameters": [_QUEUE],
                "responses": {
                    "200": {"description": "Size", "content": _json_content(_ref("QueueSize"))},
                    "401": _ERRORS["401"],
                    "404": _NOT_FOUND,
                    "503": _ERRORS["503"],
                },
            },
            "patch": {
                "summary": "Flush delayed mail: deferred and delayed messages become due now (James: delayed=true, "
                           "body {\"delayed\": false})",
                "operationId": "flushDelayed",
                "parameters": [_QUEUE, _q("delayed", "Must be true", {"type": "string", "enum": ["true"]}, required=True)],
                "requestBody": {
                    "required": True,
                    "content": _json_content({
                        "type": "object",
                        "properties": {"delayed": {"const": False}},
                        "required": ["delayed"],
                        "additionalProperties": False,
                    }),
                },
                "responses": {
                    "200": {"description": "What was flushed", "content": _json_content(_ref("ActionResult"))},
                    **_ERRORS,
                    "404": _NOT_FOUND,
                    "500": _error("The queue log cannot be written"),
                },
            },
        },
        "/mailQueues/{name}/mails": {
            "get": {
                "summary": "List messages, oldest first, consistent as of one log position",
                "operationId": "listMails",
                "parameters": [
                    _QUEUE,
                    *_FILTERS,
                    _q("limit", "At most this many messages (a page; next names the page after it)",
                       {"type": "integer", "minimum": 1}),
                    _q("after", "The page after this cursor (the next of the page before): ARRIVAL_TIME:QUEUE_ID. "
                       "Pages are in listing order (arrival time, then queue ID); a message queued for the whole "
                       "paging is on exactly one page, whatever is added or removed meanwhile", _STR),
                ],
                "responses": {
                    "200": {
                        "description": "The listing; with Accept: application/x-ndjson the mails alone, one "
                                       "JSON object (a Mail) a line, and the rest in the headers",
                        "content": {**_json_content(_ref("Listing")), "application/x-ndjson": {"schema": _STR}},
                        "headers": {
                            "X-Mtaq-Position": {"description": "x-ndjson: the log position the listing is "
                                                               "consistent as of", "schema": _STR},
                            "X-Mtaq-Count": {"description": "x-ndjson: the number of lines", "schema": _STR},
                            "X-Mtaq-Next": {"description": "x-ndjson: the cursor of the next page (absent "
                                                           "after the last)", "schema": _STR},
                            "X-Mtaq-Damage": {"description": "x-ndjson: problems met in the log, a JSON array "
                                                             "of strings (at most 8 KiB)", "schema": _STR},
                        },
                    },
                    **_ERRORS,
                    "404": _NOT_FOUND,
                },
            },
            "delete": {
                "summary": "Delete the messages the filters select (at least one filter; no DSN is sent)",
                "operationId": "deleteMails",
                "parameters": [
                    _QUEUE,
                    _q("name", "A queue ID (may repeat)", _STR),
                    *_FILTERS,
                ],
                "responses": {
                    "200": {"description": "What was deleted", "content": _json_content(_ref("ActionResult"))},
                    **_ERRORS,
                    "404": _NOT_FOUND,
                    "500": _error("The queue log cannot be written"),
                },
            },
        },
        "/mails/{queue_id}": {
            "get": {
                "summary": "One message: envelope, recipients with their last reason, header section",
                "operationId": "showMail",
                "parameters": [_p("queue_id", "The queue ID (from '250 2.0.0 Ok: queued as ID')")],
                "responses": {
                    "200": {"description": "The message", "content": _json_content(_ref("MailDetail"))},
                    "401": _ERRORS["401"],
                    "404": _NOT_FOUND,
                    "503": _ERRORS["503"],
                },
            }
        },
        "/mails/actions/{action}": {
            "post": {
                "summary": "delete, hold, release, flush (due now), bounce (return to sender with 5.4.7) or delay "
                           "(parked for 'delay', at most delay_max_s: 400 beyond it)",
                "operationId": "mailAction",
                "parameters": [{
                    "name": "action", "in": "path", "required": True, "description": "The action",
                    "schema": {"type": "string", "enum": ["delete", "hold", "release", "flush", "bounce", "delay"]},
                }],
                "requestBody": {"required": True, "content": _json_content(_ref("ActionRequest"))},
                "responses": {
                    "200": {"description": "What was done", "content": _json_content(_ref("ActionResult"))},
                    **_ERRORS,
                    "404": _NOT_FOUND,
                    "500": _error("The queue log cannot be written"),
                },
            }
        },
        "/reload": {
            "post": {
                "summary": "Read the configuration again (mtaq reload, postfix reload): every worker applies it to "
                           "new SMTP sessions and new delivery attempts, or, when anything is wrong, changes "
                           "nothing and says why; keys that need a restart are kept and named",
                "operationId": "reload",
                "requestBody": {"required": False, "content": _json_content({"type": "object"})},
                "responses": {
                    "200": {"description": "What each worker did (applied is true only when every one did)",
                            "content": _json_content(_ref("ReloadResult"))},
                    "401": _ERRORS["401"],
                    "503": _error("This daemon has no configuration source to read again"),
                },
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics (text format 0.0.4)",
                "operationId": "metrics",
                "responses": {
                    "200": {"description": "Metrics", "content": {"text/plain": {"schema": _STR}}},
                    "401": _ERRORS["401"],
                },
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "This document",
                "operationId": "openapi",
                "responses": {
                    "200": {"description": "OpenAPI 3.1", "content": _json_content({"type": "object"})},
                    "401": _ERRORS["401"],
                },
            }
        },
    },
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                       "description": "admin_token, or the token generated at the first "
                                                      "start into SPOOL/admin.token (mode 0600)"}},
        "schemas": {
            "Error": {
                "type": "object",
                "properties": {"statusCode": {"type": "integer"}, "type": _STR, "message": _STR},
                "required": ["statusCode", "type", "message"],
            },
            "QueueSize": {
                "type": "object",
                "properties": {
                    "name": _STR,
                    "size": {"type": "integer", "description": "Messages in the queue"},
                    "byState": {
                        "type": "object",
                        "properties": {s: {"type": "integer"} for s in
                                       ("incoming", "active", "deferred", "delayed", "held")},
                    },
                    "position": {"type": "string", "description": "Log position SEGMENT:OFFSET the counts are as of "
                                 "(several shards: SHARD/SEGMENT:OFFSET each, space-separated)"},
                },
                "required": ["name", "size", "byState", "position"],
            },
            "Recipient": {
                "type": "object",
                "properties": {"address": _STR, "delay_reason": {"type": "string", "description": "Last reply"}},
                "required": ["address"],
            },
            "Mail": {
                "type": "object",
                "description": "One message, like postqueue -j",
                "properties": {
                    "queue_name": {"type": "string", "description": "The state"},
                    "queue_id": _STR,
                    "arrival_time": {"type": "integer", "description": "UTC seconds since the epoch"},
                    "message_size": {"type": "integer", "description": "Bytes"},
                    "sender": _STR,
                    "recipients": {"type": "array", "items": _ref("Recipient")},
                    "state": {"type": "string", "enum": ["incoming", "active", "deferred", "delayed", "held"]},
                    "attempts": {"type": "integer"},
                    "position": {"type": "string", "description": "Log position of its envelope"},
                    "release_time": {"type": "number", "description": "Delayed mail: UTC seconds"},
                    "next_attempt_time": {"type": "number", "description": "Deferred mail: UTC seconds"},
                },
                "required": ["queue_name", "queue_id", "arrival_time", "message_size", "sender", "recipients", "state"],
            },
            "MailDetail": {
                "allOf": [_ref("Mail"), {
                    "type": "object",
                    "properties": {
                        "position_as_of": _STR,
                        "mail_params": {"type": "array", "items": {"type": "array", "items": _STR}},
                        "client": _STR,
                        "helo": _STR,
                        "generation": {"type": "integer"},
                        "bounce_of": {"type": ["string", "null"]},
                        "recipients_detail": {"type": "array", "items": {"type": "object"}},
                        "headers": {"type": "array", "items": {"type": "array", "items": _STR}},
                        "headers_error": _STR,
                    },
                }],
            },
            "Listing": {
                "type": "object",
                "properties": {
                    "name": _STR,
                    "position": {"type": "string", "description": "The listing is consistent as of this log position"},
                    "count": {"type": "integer"},
                    "next": {"type": ["string", "null"],
                             "description": "Cursor of the next page (give it as after); null after the last page"},
                    "damage": {"type": "array", "items": _STR,
                               "description": "Damage met in the log while reading it (a frame that does not "
                                              "check out: segment, offset, reason), one line each; empty when none"},
                    "mails": {"type": "array", "items": _ref("Mail")},
                },
                "required": ["name", "position", "count", "next", "damage", "mails"],
            },
            "ActionRequest": {
                "type": "object",
                "description": "ids or all choose the candidates; the other fields narrow them",
                "properties": {
                    "ids": {"type": "array", "items": _STR},
                    "all": _BOOL,
                    "sender": _STR,
                    "recipient": _STR,
                    "domain": _STR,
                    "held": _BOOL,
                    "deferred": _BOOL,
                    "olderThan": {"type": ["string", "number"], "description": "Seconds, or 30m, 2h, 1d, 1w"},
                    "delay": {"type": ["string", "number"],
                              "description": "Action delay only (required there): seconds, or 30m, 2h, 1d"},
                },
                "additionalProperties": False,
            },
            "ReloadResult": {
                "type": "object",
                "properties": {
                    "applied": _BOOL,
                    "workers": {"type": "array", "items": {
                        "type": "object",
                        "properties": {
                            "shard": {"type": "integer"},
                            "applied": {"type": "boolean", "description": "False: nothing changed (see problems)"},
                            "changed": {"type": "array", "items": _STR, "description": "Keys changed and applied"},
                            "restart_needed": {"type": "array", "items": _STR,
                                               "description": "Keys changed that keep their old value until a restart"},
                            "problems": {"type": "array", "items": _STR, "description": "One line each"},
                            "sasl_hold_cleared": {"type": "array", "items": _STR,
                                                  "description": "Password-file keys whose SASL hold ended"},
                        },
                        "required": ["shard", "applied", "changed", "restart_needed", "problems"],
                    }},
                },
                "required": ["applied", "workers"],
            },
            "ActionResult": {
                "type": "object",
                "properties": {
                    "action": _STR,
                    "position": {"type": "string", "description": "The selection was made as of this log position"},
                    "done": {"type": "array", "items": _STR},
                    "skipped": {"type": "object", "additionalProperties": _STR,
                                "description": "Queue ID -> why (e.g. delivery in progress)"},
                },
                "required": ["action", "position", "done", "skipped"],
            },
        },
    },
}


# Every route: a foreign Host or Origin gets 403; a state change without a JSON content type gets 415; a
# request slower than admin_request_timeout_s gets 408, a body over admin_body_bytes_max 413, a connection
# over admin_connections_max 503 (each closing the connection).
for _ops in SPEC["paths"].values():
    for _method, _op in _ops.items():
        _op["responses"]["403"] = _error("Host or Origin is not this API's (DNS rebinding, cross-site request)")
        _op["responses"]["408"] = _error("Headers and body did not arrive within admin_request_timeout_s (closed)")
        _op["responses"].setdefault("503", _error("admin_connections_max connections open (closed at once)"))
        if _method != "get":
            _op["responses"]["413"] = _error("Body over admin_body_bytes_max (closed, unread)")
            _op["responses"]["415"] = _error("A state change without Content-Type: application/json")


def dumps() -> str:
    """The document as the text of docs/admin_api.openapi.json (indented, keys in order, final newline)."""
    return json.dumps(SPEC, indent=2) + "\n"


if __name__ == "__main__":  # pragma: no cover
    sys.stdout.write(dumps())
