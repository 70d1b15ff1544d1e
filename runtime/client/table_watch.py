# SHIM(issue17): moved to eaas.runtime.tables.watch; remove at merge
from eaas.runtime.tables.watch import (  # noqa: F401
    TABLE_KEY,
    ConfigMapTableWatcher,
    load_kube_config,
    parse_configmap_ref,
    table_from_configmap,
)
