"""Binds kernel tables, and users' single targets, into the XLA statically linked inside
torch_xla's `_XLAC`.

No runtime exports its XLA_FFI_Api*, but `_XLAC` keeps its full symbol table: the local
function `xla::ffi::GetXlaFfiApi()` is found there, rebased on the exported `PyInit__XLAC`,
and called to get the API through which handlers are registered. Legacy custom-call functions
go into XLA's CustomCallTargetRegistry, whose Global(), Lookup() and Register() are found the
same way and called from the binder (csrc/binder.cc).
"""

import ctypes
import functools
import mmap
import os

import numpy as np
from elftools.elf.elffile import ELFFile

from torch_xla_ext import _kernels
from torch_xla_ext.errors import TorchXlaExtError

GET_API_SYMBOL = "_ZN3xla3ffi12GetXlaFfiApiEv"  # xla::ffi::GetXlaFfiApi()
ANCHOR_SYMBOL = "PyInit__XLAC"
_STRING = "NSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE"
# xla::CustomCallTargetRegistry::Global(), ::Lookup(const string&, const string&) const and
# ::Register(const string&, void*, const string&).
REGISTRY_SYMBOLS = {
    "global": "_ZN3xla24CustomCallTargetRegistry6GlobalEv",
    "lookup": f"_ZNK3xla24CustomCallTargetRegistry6LookupERK{_STRING}S8_",
    "register": f"_ZN3xla24CustomCallTargetRegistry8RegisterERK{_STRING}PvS8_",
}
# torch_xla 2.9's XLA: FFI API 0.1, whose XLA_FFI_Api struct is 192 bytes.
SUPPORTED = "torch_xla 2.9.0 from PyPI (XLA FFI API 0.1)"

_ELF_SYM = np.dtype([("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"),
                     ("value", "<u8"), ("size", "<u8")])
_STT_FUNC = 2


def _symbol_values(path, names):
    """st_value of each name in the ELF file's .symtab, or None where absent.

    pyelftools reads the headers; the table itself (half a million entries in _XLAC) is
    scanned with numpy, since building pyelftools' name index takes over ten seconds.
    """
    with open(path, "rb") as f:
        elf = ELFFile(f)
        symtab = elf.get_section_by_name(".symtab")
        if symtab is None:
            return {name: None for name in names}
        strtab = elf.get_section(symtab["sh_link"])
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            syms = np.frombuffer(data, dtype=_ELF_SYM, count=symtab["sh_size"] // _ELF_SYM.itemsize,
                                 offset=symtab["sh_offset"])
            start, end = strtab["sh_offset"], strtab["sh_offset"] + strtab["sh_size"]
            found = {}
            for name in names:
                found[name] = None
                at = data.find(b"\0" + name.encode() + b"\0", start, end)
                if at < 0:
                    continue
                hits = np.nonzero((syms["name"] == at + 1 - start) &
                                  ((syms["info"] & 0xF) == _STT_FUNC))[0]
                if hits.size:
                    found[name] = int(syms["value"][hits[0]])
            del syms
            return found
        finally:
            data.close()


def _read_version(binder, api):
    struct_size, major, minor = ctypes.c_size_t(), ctypes.c_int32(), ctypes.c_int32()
    binder.xla_ext_ffi_api_version(api, ctypes.byref(struct_size), ctypes.byref(major),
                                   ctypes.byref(minor))
    return struct_size.value, (major.value, minor.value)


class TorchXlaRuntime:
    """torch_xla's in-process XLA. Its only platform is the CPU ("Host")."""

    name = "torch_xla"
    platform = "Host"

    def __init__(self):
        import torch_xla
        from torch_xla import _XLAC

        self.torch_xla_version = getattr(torch_xla, "__version__", "unknown")
        self.path = _XLAC.__file__
        values = _symbol_values(self.path, [GET_API_SYMBOL, ANCHOR_SYMBOL,
                                            *REGISTRY_SYMBOLS.values()])
        missing = next((name for name, value in values.items() if value is None), None)
        if missing is not None:
            raise TorchXlaExtError(
                f"torch_xla {self.torch_xla_version}: {missing} is not in the symbol table of "
                f"{self.path}, so its XLA cannot be given our handlers. Supported: {SUPPORTED}. "
                "Install torch_xla==2.9.0 from PyPI, or build torch_xla with patches/ "
                "(which links the kernels into _XLAC)."
            )
        loaded = ctypes.CDLL(self.path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        base = ctypes.cast(loaded.PyInit__XLAC, ctypes.c_void_p).value - values[ANCHOR_SYMBOL]
        get_api = ctypes.CFUNCTYPE(ctypes.c_void_p)(base + values[GET_API_SYMBOL])
        self._registry = {role: base + values[symbol] for role, symbol in REGISTRY_SYMBOLS.items()}
        self.api = get_api()
        if not self.api:
            raise TorchXlaExtError(f"torch_xla {self.torch_xla_version}: GetXlaFfiApi() returned null")
        self._binder = _kernels.binder_dll()
        self.struct_size, self.ffi_version = _read_version(self._binder, self.api)
        if self.ffi_version != (0, 1) or self.struct_size != 192:
            raise TorchXlaExtError(
                f"torch_xla {self.torch_xla_version} speaks XLA FFI API "
                f"{self.ffi_version[0]}.{self.ffi_version[1]} (XLA_FFI_Api of {self.struct_size} "
                f"bytes); supported: {SUPPORTED}. Install torch_xla==2.9.0, or rebuild the "
                "kernels against the FFI headers of this torch_xla's XLA."
            )

    def bind(self, library):
        _kernels.call_binder(self._binder.xla_ext_bind_ffi_api, self.api, library, self.platform)
        return [(k.target, k.platform) for k in library.kernels if k.platform == self.platform]

    def register_target(self, target):
        """A user's target (custom_call_targets.Target): a typed FFI handler through the
        XLA_FFI_Api, a legacy function into the CustomCallTargetRegistry."""
        name, platform = target.name.encode(), self.platform.encode()
        _kernels.register_target(
            target,
            functools.partial(self._binder.xla_ext_register_ffi_handler, self.api, name, platform,
                              target.address, 0),
            functools.partial(self._binder.xla_ext_registry_register, self._registry["global"],
                              self._registry["lookup"], self._registry["register"], name,
                              target.address, platform),
            "torch_xla's XLA")

    def has_legacy_target(self, name):
        return bool(self._binder.xla_ext_registry_lookup(
            self._registry["global"], self._registry["lookup"], name.encode(),
            self.platform.encode()))

    def describe(self):
        return {
            "name": self.name,
            "kind": "in-process XLA (torch_xla._XLAC)",
            "version": self.torch_xla_version,
            "ffi_api": "%d.%d" % self.ffi_version,
            "platforms": [self.platform],
        }
