// HvdliteAsyncCall: a TensorFlow asynchronous kernel that hands its inputs to Python and
// finishes when Python says so, holding no thread of the inter-op pool meanwhile.
//
// hvdlite's collectives are Python code that blocks until every rank has submitted the
// same collective.  Run by a synchronous kernel (a py_function), each waiting collective
// holds a thread of a TF1 session's small inter-op pool, and ranks that start different
// collectives first can then wait for each other forever.  This kernel instead calls
// hvdlite.tensorflow.graph.async_call._dispatch(key, inputs, complete) under the GIL and returns;
// Python runs the collective on a thread of its own and calls complete(...) once, with the
// outputs or with an error.  See async_call.py for the Python half.
#include <Python.h>

#include <cstring>
#include <string>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

using tensorflow::AsyncOpKernel;
using tensorflow::DataTypeSize;
using tensorflow::DataTypeVector;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;

REGISTER_OP("HvdliteAsyncCall")
    .Input("inputs: Tin")
    .Output("outputs: Tout")
    .Attr("Tin: list(type) >= 0")
    .Attr("Tout: list(type) >= 0")
    .Attr("key: int")
    .SetIsStateful()
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      for (int i = 0; i < c->num_outputs(); ++i) c->set_output(i, c->UnknownShape());
      return absl::OkStatus();
    });

namespace {

// One call in flight: what complete() needs to finish it.  Owned by the capsule bound to
// the complete() function handed to Python; done is called exactly once, by complete() or,
// if Python drops complete() unused, by the capsule's destructor.
struct Call {
  OpKernelContext* ctx;
  AsyncOpKernel::DoneCallback done;
  std::vector<Tensor> inputs;  // kept alive while Python may read their memory
  DataTypeVector touts;
  bool finished = false;
};

const char kCapsule[] = "hvdlite.async_call";

// Calls done() with the GIL released: TensorFlow may run the next nodes inline, and one of
// them may be another call that needs the GIL from a thread of its own.
void Finish(Call* call, const absl::Status& status) {
  call->finished = true;
  if (!status.ok()) call->ctx->SetStatus(status);
  AsyncOpKernel::DoneCallback done = std::move(call->done);
  call->inputs.clear();
  Py_BEGIN_ALLOW_THREADS done();
  Py_END_ALLOW_THREADS
}

void DropCapsule(PyObject* capsule) {
  Call* call = static_cast<Call*>(PyCapsule_GetPointer(capsule, kCapsule));
  if (call == nullptr) return;
  if (!call->finished)
    Finish(call, absl::InternalError("hvdlite: a collective's Python side ended without a "
                                     "result (it was dropped unfinished)"));
  delete call;
}

// The outputs' bytes: each output is a pair (shape tuple, C-contiguous buffer of bytes).
absl::Status SetOutputs(Call* call, PyObject* outputs) {
  PyObject* seq = PySequence_Fast(outputs, "hvdlite: the outputs must be a sequence");
  if (seq == nullptr) return absl::InternalError("hvdlite: the outputs are not a sequence");
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  absl::Status status;
  if (n != static_cast<Py_ssize_t>(call->touts.size()))
    status = absl::InternalError("hvdlite: a collective returned " + std::to_string(n) +
                                 " outputs, expected " + std::to_string(call->touts.size()));
  for (Py_ssize_t i = 0; status.ok() && i < n; ++i) {
    PyObject* shape_obj = nullptr;
    PyObject* data_obj = nullptr;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "OO", &shape_obj, &data_obj)) {
      PyErr_Clear();
      status = absl::InternalError("hvdlite: an output is not a (shape, bytes) pair");
      break;
    }
    TensorShape shape;
    PyObject* dims = PySequence_Fast(shape_obj, "shape");
    if (dims == nullptr) {
      PyErr_Clear();
      status = absl::InternalError("hvdlite: an output's shape is not a sequence");
      break;
    }
    for (Py_ssize_t d = 0; d < PySequence_Fast_GET_SIZE(dims); ++d)
      shape.AddDim(PyLong_AsLongLong(PySequence_Fast_GET_ITEM(dims, d)));
    Py_DECREF(dims);
    Py_buffer view;
    if (PyObject_GetBuffer(data_obj, &view, PyBUF_C_CONTIGUOUS) != 0) {
      PyErr_Clear();
      status = absl::InternalError("hvdlite: an output's data is not a contiguous buffer");
      break;
    }
    const int64_t want = shape.num_elements() * DataTypeSize(call->touts[i]);
    Tensor* out = nullptr;
    if (view.len != want) {
      status = absl::InternalError("hvdlite: output " + std::to_string(i) + " has " +
                                   std::to_string(view.len) + " bytes, its shape needs " +
                                   std::to_string(want));
    } else {
      status = call->ctx->allocate_output(static_cast<int>(i), shape, &out);
      if (status.ok() && want > 0) std::memcpy(out->data(), view.buf, want);
    }
    PyBuffer_Release(&view);
  }
  Py_DECREF(seq);
  return status;
}

// complete(outputs, code, message): code 0 sets the outputs, any other fails the call with
// that TensorFlow error code and message.
PyObject* Complete(PyObject* capsule, PyObject* args) {
  Call* call = static_cast<Call*>(PyCapsule_GetPointer(capsule, kCapsule));
  if (call == nullptr) return nullptr;
  PyObject* outputs = nullptr;
  int code = 0;
  const char* message = "";
  if (!PyArg_ParseTuple(args, "Ois", &outputs, &code, &message)) return nullptr;
  if (call->finished) {
    PyErr_SetString(PyExc_RuntimeError, "hvdlite: this collective was already completed");
    return nullptr;
  }
  absl::Status status =
      code == 0 ? SetOutputs(call, outputs)
                : absl::Status(static_cast<absl::StatusCode>(code), message);
  Finish(call, status);
  Py_RETURN_NONE;
}

PyMethodDef kComplete = {"complete", Complete, METH_VARARGS,
                         "Finish the collective: complete(outputs, code, message)."};

// hvdlite.tensorflow.graph.async_call._dispatch, looked up once.
PyObject* Dispatch() {
  static PyObject* dispatch = nullptr;
  if (dispatch == nullptr) {
    PyObject* module = PyImport_ImportModule("hvdlite.tensorflow.graph.async_call");
    if (module == nullptr) return nullptr;
    dispatch = PyObject_GetAttrString(module, "_dispatch");
    Py_DECREF(module);
  }
  return dispatch;
}

std::string PythonError() {
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  std::string text = "hvdlite: the collective could not be handed to Python";
  if (value != nullptr) {
    PyObject* str = PyObject_Str(value);
    if (str != nullptr) {
      const char* utf8 = PyUnicode_AsUTF8(str);
      if (utf8 != nullptr) text += std::string(": ") + utf8;
      Py_DECREF(str);
    }
  }
  PyErr_Clear();
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(traceback);
  return text;
}

class AsyncCallOp : public AsyncOpKernel {
 public:
  explicit AsyncCallOp(OpKernelConstruction* c) : AsyncOpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("key", &key_));
    OP_REQUIRES_OK(c, c->GetAttr("Tout", &touts_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    Call* call = new Call{ctx, std::move(done), {}, touts_};
    for (int i = 0; i < ctx->num_inputs(); ++i) call->inputs.push_back(ctx->input(i));
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject* capsule = PyCapsule_New(call, kCapsule, DropCapsule);
    PyObject* complete = capsule ? PyCFunction_New(&kComplete, capsule) : nullptr;
    Py_XDECREF(capsule);  // complete holds it
    PyObject* inputs = PyList_New(0);
    for (const Tensor& t : call->inputs) {
      PyObject* dims = PyTuple_New(t.dims());
      for (int d = 0; d < t.dims(); ++d)
        PyTuple_SET_ITEM(dims, d, PyLong_FromLongLong(t.dim_size(d)));
      const auto bytes = t.tensor_data();
      PyObject* view = PyMemoryView_FromMemory(const_cast<char*>(bytes.data()),
                                               static_cast<Py_ssize_t>(bytes.size()),
                                               PyBUF_READ);
      PyObject* item = Py_BuildValue("(iNN)", static_cast<int>(t.dtype()), dims, view);
      PyList_Append(inputs, item);
      Py_XDECREF(item);
    }
    PyObject* dispatch = Dispatch();
    PyObject* result = nullptr;
    if (dispatch != nullptr && complete != nullptr)
      result = PyObject_CallFunction(dispatch, "LOO", static_cast<long long>(key_), inputs,
                                     complete);
    if (result == nullptr) {
      const std::string text = PythonError();
      if (!call->finished) {
        // complete was not kept by anyone who could still call it: fail the call now
        call->finished = true;
        ctx->SetStatus(absl::InternalError(text));
        DoneCallback finish = std::move(call->done);
        call->inputs.clear();
        Py_XDECREF(inputs);
        Py_XDECREF(complete);
        PyGILState_Release(gil);
        finish();
        return;
      }
    }
    Py_XDECREF(result);
    Py_XDECREF(inputs);
    Py_XDECREF(complete);
    PyGILState_Release(gil);
  }

 private:
  int64_t key_;
  DataTypeVector touts_;
};

}  // namespace

REGISTER_KERNEL_BUILDER(Name("HvdliteAsyncCall").Device(tensorflow::DEVICE_CPU), AsyncCallOp);
