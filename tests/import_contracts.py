"""An import-linter contract type for one part of an external package (pyproject.toml, [tool.importlinter]).

import-linter's graph keeps an external package as one node (`torch`), so its built-in contracts cannot say
"only odb_core.ranks imports torch.distributed". `ExternalSubmoduleContract` reads the source line of every
import of the external root package instead and refuses any that names the submodule outside the allowed
importers. `tests/test_layers.py` runs it with the other contracts and checks that it fails on a violation.
"""

from __future__ import annotations

import re

from importlinter.application import output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck


class ExternalSubmoduleContract(Contract):
    """Only `allowed_importers` (and their descendants) may import `submodule` of an external package."""

    type_name = "external_submodule"
    submodule = fields.StringField()
    allowed_importers = fields.ListField(subfield=fields.StringField())

    def check(self, graph, verbose: bool) -> ContractCheck:
        root, _, rest = self.submodule.partition(".")
        # `import torch.distributed`, `from torch.distributed import x`, `from torch import distributed`
        names = re.compile(rf"\b{re.escape(self.submodule)}\b"
                           rf"|^\s*from\s+{re.escape(root)}\s+import\s+.*\b{re.escape(rest)}\b")
        allowed = tuple(self.allowed_importers)
        violations = []
        for importer in sorted(graph.find_modules_that_directly_import(root)):
            if any(importer == a or importer.startswith(a + ".") for a in allowed):
                continue
            for detail in graph.get_import_details(importer=importer, imported=root):
                if names.search(detail["line_contents"]):
                    violations.append(f"{importer}:{detail['line_number']}: {detail['line_contents']}")
        return ContractCheck(kept=not violations, metadata={"violations": violations})

    def render_broken_contract(self, check: ContractCheck) -> None:
        output.print_error(f"{self.submodule} may be imported only by {', '.join(self.allowed_importers)}:")
        output.new_line()
        for line in check.metadata["violations"]:
            output.print_error(f"-   {line}", bold=False)
        output.new_line()
