"""Single calls waiting for a person's approval (``ask = true`` capabilities): list,
show, approve, deny."""

from __future__ import annotations

from fastapi import APIRouter

from proctor.api._errors import ERROR_RESPONSES

router = APIRouter(responses=ERROR_RESPONSES)
