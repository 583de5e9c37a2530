"""An import-linter contract, `own_package`: no module imports a package it belongs to.

import-linter's `acyclic_siblings` finds a cycle between the children of a package at every depth, so
between any two files, except through a package's own `__init__`: `pkg/__init__.py` re-exporting `pkg.a`
while `pkg/a.py` does `from pkg import Shared` is a cycle of two files that no pair of siblings shows. This
contract forbids the import that closes such a cycle (a module importing one of its ancestors), so together
the two leave no cycle between files. Like every contract of `make lint` it counts imports under
`if TYPE_CHECKING:` and inside functions (grimp reads every import statement).

    [[tool.importlinter.contracts]]
    name = "..."
    type = "own_package"
    containers = ["asyncrlhf", "services"]
"""

from __future__ import annotations

import grimp
from importlinter.application import output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck


class OwnPackageContract(Contract):
    """Kept when no module under `containers` imports a package that contains it."""

    containers = fields.ListField(subfield=fields.StringField())

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        found = []
        for container in self.containers:  # type: ignore[attr-defined]
            for module in sorted(graph.find_descendants(container)):
                for imported in sorted(graph.find_modules_directly_imported_by(module)):
                    if module.startswith(f"{imported}."):
                        lines = [d["line_number"] for d in
                                 graph.get_import_details(importer=module, imported=imported)]
                        found.append((module, imported, lines))
        return ContractCheck(kept=not found, metadata={"imports": found})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for module, imported, lines in check.metadata["imports"]:
            where = ", ".join(f"l.{n}" for n in lines)
            output.print_error(f"{module} imports its own package {imported} ({where})", bold=False)
        output.new_line()
        output.print("Import from the module that defines the name, not from the package that re-exports it.")
