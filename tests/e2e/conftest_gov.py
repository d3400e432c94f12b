"""A governed runtime for end-to-end tests: a real home, real sandboxes, the real broker.

Built through the library (fast) rather than the CLI; the CLI has its own tests.
"""

from __future__ import annotations

import random
import sqlite3
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proctor.governance import Principal
from proctor.ledger import Actor
from proctor.runtime import Runtime, init_home

CUSTOMERS = 300


def make_crm(path: Path, n: int = CUSTOMERS) -> None:
    db = sqlite3.connect(path)
    db.execute(
        "CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, email TEXT, country TEXT,"
        " plan TEXT, mrr REAL)"
    )
    rng = random.Random(42)
    db.executemany(
        "INSERT INTO customers VALUES (?, ?, ?, ?, ?, ?)",
        [
            (i, f"Name {i}", f"user{i}@example.com", rng.choice(["DE", "FR", "US"]),
             rng.choice(["free", "pro", "team"]), round(rng.uniform(0, 300), 2))
            for i in range(1, n + 1)
        ],
    )  # fmt: skip
    db.commit()
    db.close()


@dataclass
class Gov:
    home: Path
    rt: Runtime
    people: dict[str, tuple[Principal, str]]

    @property
    def op(self) -> Actor:
        return self.rt.operator

    def principal(self, name: str) -> Principal:
        return self.people[name][0]

    def token(self, name: str) -> str:
        return self.people[name][1]

    def artifact_dir(self, name: str, main: str, manifest_extra: str = "", **kw: Any) -> Path:
        d = self.home.parent / f"art-{name}-{random.randrange(1 << 30):x}"
        d.mkdir(mode=0o755)
        (d / "main.py").write_text(textwrap.dedent(main))
        (d / "proctor.toml").write_text(
            textwrap.dedent(
                f"""\
                [artifact]
                name = "{name}"
                entrypoint = ["python3", "main.py"]
                purpose = "testing {name}"
                """
            )
            + textwrap.dedent(manifest_extra)
        )
        for f in d.iterdir():
            f.chmod(0o644)
        return d

    def submit(self, tenant: str, directory: Path, author: str = "dev") -> str:
        return self.rt.artifacts.submit(tenant, directory, self.principal(author).actor).digest


def build_gov(tmp: Path) -> Gov:
    home = tmp / "home"
    init_home(home)
    rt = Runtime.open(home)
    op = rt.operator
    people: dict[str, tuple[Principal, str]] = {}
    for tenant in ("acme", "globex"):
        rt.tenants.create(tenant, op)
        for name, roles in [("dev", ["developer"]), ("alice", ["approver"]),
                            ("bob", ["approver"]), ("root", ["admin"])]:  # fmt: skip
            p, tok = rt.principals.create(tenant, name, "user", roles, op)
            people[name if tenant == "acme" else f"{tenant}-{name}"] = (p, tok)
    make_crm(tmp / "crm.db")
    make_crm(tmp / "fake.db", 50)
    rt.resources.add_dataset("acme", "crm", tmp / "crm.db", op)
    rt.resources.add_dataset("acme", "fake", tmp / "fake.db", op, synthetic=True)
    rt.resources.add_bucket("acme", "reports", op)
    return Gov(home, rt, people)
