# SHIM(issue17): moved to eaas.runtime.tables.table; remove at merge
from eaas.runtime.tables.table import RoutingTable  # noqa: F401

# SHIM(issue17): moved to eaas.runtime.tables.wire; remove at merge
from eaas.runtime.tables.wire import INT64_MAX, RoutingTableError  # noqa: F401
