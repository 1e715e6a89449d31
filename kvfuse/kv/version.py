"""The entry format's version: part of every entry header (``kv/format.py``) and of every key's
namespace (``kv/keys.py``), so that entries of another version are misses, never misread. In a
module of its own because both of those modules need it and the format module needs the keys.
"""

FORMAT_VERSION = 3
