"""(being written)"""

FAMILIES = ()
