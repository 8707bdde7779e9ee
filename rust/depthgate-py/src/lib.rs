//! Thin PyO3 bindings: `depthgate._core`. Each function extracts owned inputs, releases the GIL
//! for the core call (`detach`), and converts the result: token ids leave as numpy arrays without
//! copying, small reports as JSON that the typed Python front validates.

mod errors;

use std::path::PathBuf;

use depthgate_core::spec::{BatchSpec, Span};
use depthgate_core::{CoreError, SendContract, StoredLayout, TargetTokenizer};
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;

use crate::errors::{CoreResult, PyCoreError};

/// Run a core call with the GIL released and map its error once.
fn detached<T: Send>(
    py: Python<'_>,
    f: impl FnOnce() -> depthgate_core::Result<T> + Send,
) -> PyResult<T> {
    py.detach(f).map_err(|e| PyCoreError(e).into())
}

fn spec_error(field: &str, detail: impl ToString, fix: &str) -> PyErr {
    PyCoreError(CoreError::Spec {
        field: field.into(),
        detail: detail.to_string(),
        fix: fix.into(),
    })
    .into()
}

/// A loaded target tokenizer (immutable, shareable across threads).
#[pyclass(frozen, module = "depthgate._core", name = "Tokenizer")]
struct PyTokenizer {
    inner: TargetTokenizer,
}

#[pymethods]
impl PyTokenizer {
    #[staticmethod]
    fn from_file(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        let inner = detached(py, || TargetTokenizer::from_file(&path))?;
        Ok(PyTokenizer { inner })
    }

    #[getter]
    fn digest(&self) -> &str {
        &self.inner.digest
    }

    #[getter]
    fn special_head(&self) -> Vec<u32> {
        self.inner.special_head.clone()
    }

    #[getter]
    fn special_tail(&self) -> Vec<u32> {
        self.inner.special_tail.clone()
    }

    #[getter]
    fn bos_id(&self) -> Option<u32> {
        self.inner.bos_id()
    }

    #[getter]
    fn fast_unsound_reason(&self) -> Option<String> {
        self.inner.fast_unsound_reason.clone()
    }

    #[getter]
    fn special_strings(&self) -> Vec<String> {
        self.inner.special_strings.clone()
    }

    fn encode<'py>(
        &self,
        py: Python<'py>,
        text: String,
        add_special_tokens: bool,
    ) -> PyResult<Bound<'py, PyArray1<u32>>> {
        let ids = detached(py, || self.inner.encode_ids(&text, add_special_tokens))?;
        Ok(ids.into_pyarray(py))
    }
}

/// Flat token ids of all layouts, their row offsets (n + 1), and the layouts' metadata as JSON.
type BuiltBatch<'py> = (Bound<'py, PyArray1<u32>>, Bound<'py, PyArray1<u64>>, String);

/// Build a batch of layouts. Returns (flat token ids, row offsets, layouts JSON without ids).
#[pyfunction]
fn build_layouts<'py>(
    py: Python<'py>,
    tokenizer: &PyTokenizer,
    spec_json: String,
) -> PyResult<BuiltBatch<'py>> {
    let spec: BatchSpec = serde_json::from_str(&spec_json).map_err(|e| {
        spec_error(
            "spec",
            e,
            "build the spec with depthgate.layout.layouts (pydantic), not by hand",
        )
    })?;
    let (flat, offsets, meta) = detached(py, || {
        let mut layouts = depthgate_core::build_layouts(&tokenizer.inner, &spec)?;
        let total: usize = layouts.iter().map(|l| l.token_ids.len()).sum();
        let mut flat = Vec::with_capacity(total);
        let mut offsets = Vec::with_capacity(layouts.len() + 1);
        offsets.push(0u64);
        for l in &mut layouts {
            flat.append(&mut l.token_ids);
            offsets.push(flat.len() as u64);
        }
        let meta = serde_json::to_string(&layouts).map_err(|e| CoreError::Encode {
            what: "layout metadata".into(),
            detail: e.to_string(),
        })?;
        Ok((flat, offsets, meta))
    })?;
    Ok((flat.into_pyarray(py), offsets.into_pyarray(py), meta))
}

/// Re-verify stored layouts from scratch (full re-encode). Returns violations per layout as JSON.
#[pyfunction]
fn verify_layouts(
    py: Python<'_>,
    tokenizer: &PyTokenizer,
    layouts_json: String,
    ids_flat: PyReadonlyArray1<'_, u32>,
    row_offsets: PyReadonlyArray1<'_, u64>,
) -> PyResult<String> {
    let layouts: Vec<StoredLayout> = serde_json::from_str(&layouts_json).map_err(|e| {
        spec_error(
            "layouts",
            e,
            "pass rows of a layouts.parquet written by depthgate build",
        )
    })?;
    let flat = ids_flat.as_slice()?.to_vec();
    let offsets = row_offsets.as_slice()?.to_vec();
    if offsets.len() != layouts.len() + 1 {
        return Err(spec_error(
            "row_offsets",
            "row offsets do not match the number of layouts",
            "pass n+1 offsets",
        ));
    }
    let out = detached(py, || {
        let rows: Vec<&[u32]> = offsets
            .windows(2)
            .map(|w| &flat[w[0] as usize..w[1] as usize])
            .collect();
        let v = depthgate_core::verify_batch(&tokenizer.inner, &layouts, &rows)?;
        serde_json::to_string(&v).map_err(|e| CoreError::Encode {
            what: "violations".into(),
            detail: e.to_string(),
        })
    })?;
    Ok(out)
}

/// Pre-send checks for one layout against the contract of the system it is sent to (JSON report).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn presend_check(
    py: Python<'_>,
    layout_id: String,
    text: String,
    ids: PyReadonlyArray1<'_, u32>,
    spans_json: String,
    layout_template_digest: String,
    layout_pinned_date: String,
    contract_json: String,
) -> PyResult<String> {
    let spans: Vec<Span> = serde_json::from_str(&spans_json).map_err(|e| {
        spec_error(
            "evidence_spans",
            e,
            "pass the spans recorded by depthgate build",
        )
    })?;
    let contract: SendContract = serde_json::from_str(&contract_json).map_err(|e| {
        spec_error(
            "contract",
            e,
            "pass target_tokens, window, max_output_tokens, template_digest, pinned_date, bos_id",
        )
    })?;
    let ids = ids.as_slice()?.to_vec();
    let report: CoreResult<String> = py.detach(|| {
        let r = depthgate_core::presend_check(
            &layout_id,
            &text,
            &ids,
            &spans,
            &layout_template_digest,
            &layout_pinned_date,
            &contract,
        );
        serde_json::to_string(&r).map_err(|e| {
            PyCoreError(CoreError::Encode {
                what: "check report".into(),
                detail: e.to_string(),
            })
        })
    });
    Ok(report?)
}

#[pymodule(gil_used = false)]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyTokenizer>()?;
    m.add_function(wrap_pyfunction!(build_layouts, m)?)?;
    m.add_function(wrap_pyfunction!(verify_layouts, m)?)?;
    m.add_function(wrap_pyfunction!(presend_check, m)?)?;
    m.add("ASSEMBLER_VERSION", depthgate_core::ASSEMBLER_VERSION)?;
    Ok(())
}
