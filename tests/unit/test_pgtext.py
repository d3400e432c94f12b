"""redact(): a DSN's password is masked wherever a DSN can carry one."""

from __future__ import annotations

import pytest

from proctor.store import redact

SECRET = "s3cr3t-Pw"

#: Every place a libpq DSN can hold a password, and the forms a developer writes.
DSN_FORMS = (
    f"postgresql://app:{SECRET}@127.0.0.1:5432/crm",
    f"postgres://app:{SECRET}@127.0.0.1/crm?sslmode=disable",
    f"postgresql://app@127.0.0.1:5432/crm?password={SECRET}",
    f"postgresql://app@127.0.0.1:5432/crm?sslmode=disable&password={SECRET}&connect_timeout=3",
    f"postgresql://127.0.0.1/crm?PassWord={SECRET}",
    f"postgresql://127.0.0.1/crm?%70assword={SECRET}",
    f"postgresql://127.0.0.1/crm?password=x&password={SECRET}",
    f"postgresql://127.0.0.1/crm?sslpassword={SECRET}",
    f"postgresql://127.0.0.1?password={SECRET}",
    f"postgresql://app:{SECRET}@h1:5432,h2:5433/crm",
    f"postgresql://app:p@{SECRET}@127.0.0.1/crm",
    f"postgresql://127.0.0.1?password=a@{SECRET}",
    f"host=127.0.0.1 dbname=crm password={SECRET}",
    f"host=127.0.0.1 password = {SECRET} dbname=crm",
    f"host=127.0.0.1 password='{SECRET} and more' dbname=crm",
    f"host=127.0.0.1 PASSWORD='it\\'s {SECRET}' dbname=crm",
)


@pytest.mark.parametrize("dsn", DSN_FORMS)
def test_no_form_of_dsn_keeps_its_password(dsn: str) -> None:
    out = redact(dsn)
    assert SECRET not in out
    assert "***" in out


def test_what_is_not_a_password_is_kept() -> None:
    assert redact("postgresql://app@127.0.0.1:5432/crm?sslmode=disable") == (
        "postgresql://app@127.0.0.1:5432/crm?sslmode=disable"
    )
    assert redact("postgresql://app:pw@127.0.0.1:5432/crm") == (
        "postgresql://app:***@127.0.0.1:5432/crm"
    )
    assert redact("host=h dbname=crm user=app") == "host=h dbname=crm user=app"
    assert redact("/srv/data/crm.db") == "/srv/data/crm.db"
