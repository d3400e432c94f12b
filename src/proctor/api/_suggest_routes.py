"""The least-privilege manifest a sandbox run's calls and refusals call for."""

from __future__ import annotations

from fastapi import APIRouter

from proctor.api._errors import ERROR_RESPONSES

router = APIRouter(responses=ERROR_RESPONSES)
