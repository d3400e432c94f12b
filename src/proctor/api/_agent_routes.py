"""Agents' routes: approval requests an agent makes for its artifacts, and their state."""

from __future__ import annotations

from fastapi import APIRouter

from proctor.api._errors import ERROR_RESPONSES

router = APIRouter(responses=ERROR_RESPONSES)
