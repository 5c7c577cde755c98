// The saved-tensor hooks of a layer swapped as a whole, in C++: included by _swap_store.cpp after the store's
// definitions (Store, Handle), bound with it (the Python side is OpSwaps in _op_swap.py).
//
// Note: [whole-layer pack in C++]. Inside the call of a layer swapped as a whole every tensor its ops save is
// swapped but its inputs', its parameters' and its buffers' (Note: [swap scopes] in _op_swap.py), so the pack
// needs no op name, only two sets of storages fixed for the call. In Python each save cost a pack call of
// several microseconds around the store's offload and each unpack another, more than the store itself
// (benchmarks/README "Machinery"). Where the engine has a native store, the layer call's hooks are a LayerPacker:
// a plain tensor whose storage is neither an input's nor a parameter's goes straight to Store::offload; a
// parameter's or buffer's (and a plain tensor's the store refuses) goes the way the Python pack sends it (detached
// where it has a grad_fn, Note: [pack without a cycle]; passed to the hooks entered before, Note: [scope hooks
// chain outward]); an input's storage (a swap unit's output of an earlier layer) and any tensor subclass go to the
// Python pack, which knows their producers. The unpack serves the store's handles and plain tensors itself and
// hands the rest to the Python unpack. Each call counts itself in FOOTPRINT as the Python hooks do. The garbage
// collector does not see what the packer holds: it holds the plan's objects only weakly (_layer_pack.py: weakly)
// and the call's sources and outer hooks until the call ends (release).
// tests/test_layer_pack.py checks the gradients, the bytes offloaded and the calls against the Python hooks.

struct LayerPacker {
  std::shared_ptr<Store> store;
  py::object footprint;                 // FOOTPRINT: the counters the Python hooks increment
  py::object python_pack, python_unpack;  // the Python hooks, for what they take (they count it themselves)
  py::object outer_pack, outer_unpack, outer_type;  // the hooks entered before (None: none), the Outer type
  py::object tensor_type, parameter_type;
  std::unordered_set<c10::StorageImpl*> inputs, kept;  // the call's inputs' storages; parameters' and buffers'
  py::object kept_source;  // () -> the keys of ``kept``, asked at the call's first save of a plain tensor (FSDP2
                           // sets its gathered parameters in its own pre-hook, after the scope's)
  bool kept_known = false;
  std::string label;
  int trigger = -1;
  int64_t limit = 0;

  void count(const char* name) {
    py::object n = footprint.attr(name);
    footprint.attr(name) = py::int_(n.cast<int64_t>() + 1);
  }

  py::object pass_on(py::object obj) {  // what the Python pack returns for a tensor it does not swap
    if (outer_pack.is_none()) return obj;
    return outer_type(outer_pack(obj), outer_unpack);
  }

  py::object pack(py::object obj) {
    PyTypeObject* type = Py_TYPE(obj.ptr());
    if (type == reinterpret_cast<PyTypeObject*>(parameter_type.ptr())) {
      count("pack");
      return pass_on(std::move(obj));
    }
    if (type != reinterpret_cast<PyTypeObject*>(tensor_type.ptr())) return python_pack(obj);
    const at::Tensor& t = THPVariable_Unpack(obj.ptr());
    if (!t.has_storage()) return python_pack(obj);
    c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
    if (inputs.count(impl)) return python_pack(obj);
    if (!kept_known) {
      for (py::handle key : kept_source()) kept.insert(reinterpret_cast<c10::StorageImpl*>(key.cast<int64_t>()));
      kept_known = true;
    }
    if (!kept.count(impl)) {
      py::object handle = store->offload(t, label, trigger, limit);
      if (!handle.is_none()) {
        count("pack");
        return handle;
      }
      return python_pack(obj);  // refused (over the limit or the host budget): the Python record
    }
    count("pack");
    if (t.grad_fn()) return pass_on(py::cast(t.detach()));
    return pass_on(std::move(obj));
  }

  py::object unpack(py::object x) {
    if (py::isinstance<Handle>(x)) {
      count("unpack");
      return py::cast(x.cast<Handle&>().unpack());
    }
    PyTypeObject* type = Py_TYPE(x.ptr());
    if (type == reinterpret_cast<PyTypeObject*>(tensor_type.ptr()) ||
        type == reinterpret_cast<PyTypeObject*>(parameter_type.ptr())) {
      count("unpack");
      return x;
    }
    return python_unpack(x);
  }
};

void bind_layer_packer(py::module_& m) {
  py::class_<LayerPacker, std::shared_ptr<LayerPacker>>(m, "LayerPacker")
      .def(py::init([](std::shared_ptr<Store> store, py::object footprint, py::object python_pack,
                       py::object python_unpack, py::object outer_type) {
             auto p = std::make_shared<LayerPacker>();
             p->store = std::move(store);
             p->footprint = std::move(footprint);
             p->python_pack = std::move(python_pack);
             p->python_unpack = std::move(python_unpack);
             p->outer_type = std::move(outer_type);
             py::module_ torch = py::module_::import("torch");
             p->tensor_type = torch.attr("Tensor");
             p->parameter_type = torch.attr("nn").attr("Parameter");
             p->outer_pack = p->outer_unpack = py::none();
             return p;
           }),
           py::arg("store"), py::arg("footprint"), py::arg("python_pack"), py::arg("python_unpack"),
           py::arg("outer_type"))
      .def(
          "configure",
          [](LayerPacker& p, const std::vector<int64_t>& inputs, py::object kept, const std::string& label,
             int trigger, int64_t limit, py::object outer_pack, py::object outer_unpack) {
            p.inputs.clear();
            p.kept.clear();
            for (int64_t key : inputs) p.inputs.insert(reinterpret_cast<c10::StorageImpl*>(key));
            p.kept_source = std::move(kept);
            p.kept_known = false;
            p.label = label;
            p.trigger = trigger;
            p.limit = limit;
            p.outer_pack = std::move(outer_pack);
            p.outer_unpack = std::move(outer_unpack);
          },
          py::arg("inputs"), py::arg("kept"), py::arg("label"), py::arg("trigger"), py::arg("limit"),
          py::arg("outer_pack"), py::arg("outer_unpack"))
      .def("release",
           [](LayerPacker& p) {  // the layer call ended: nothing of it stays held (the collector sees none of it)
             p.inputs.clear();
             p.kept.clear();
             p.kept_source = p.outer_pack = p.outer_unpack = py::none();
           })
      .def("pack", &LayerPacker::pack)
      .def("unpack", &LayerPacker::unpack);
}
