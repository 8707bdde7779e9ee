//! Thin PyO3 bindings: `depthgate._core`. Each function extracts owned inputs, releases the GIL
//! for the core call (`detach`), and converts the result: token ids leave as numpy arrays without
//! copying, small reports as JSON that the typed Python front validates.

mod errors;

use std::path::PathBuf;

use depthgate_core::spec::{BatchSpec, Span, UnitKind};
use depthgate_core::{CoreError, PresendRow, SendContract, StoredLayout, TargetTokenizer};
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::errors::PyCoreError;

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

/// A JSON argument from the typed Python front; a malformed one is a spec error on `field`.
fn from_json<T: DeserializeOwned>(json: &str, field: &str, fix: &str) -> PyResult<T> {
    serde_json::from_str(json).map_err(|e| spec_error(field, e, fix))
}

/// A core result as JSON for the typed Python front, which validates it.
fn to_json<T: Serialize + ?Sized>(value: &T, what: &str) -> depthgate_core::Result<String> {
    serde_json::to_string(value).map_err(|e| CoreError::Encode {
        what: what.into(),
        detail: e.to_string(),
    })
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
    fn bos_id(&self) -> Option<u32> {
        self.inner.bos_id()
    }

    #[getter]
    fn fast_unsound_reason(&self) -> Option<String> {
        self.inner.fast_unsound_reason.clone()
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

/// Flat token ids, their row offsets (n + 1), the prompt texts, and the layouts' other fields as JSON.
type BuiltColumns<'py> = (
    Bound<'py, PyArray1<u32>>,
    Bound<'py, PyArray1<u64>>,
    Vec<String>,
    String,
);

/// Build a batch of layouts, column by column. Returns (flat token ids, row offsets, the prompt texts,
/// layouts JSON without ids and texts): the texts leave as Python strings instead of inside the JSON
/// (escaping and parsing 128K-token prompts twice was the largest cost after the build itself,
/// docs/benchmarks.md).
#[pyfunction]
fn build_layout_columns<'py>(
    py: Python<'py>,
    tokenizer: &PyTokenizer,
    spec_json: String,
) -> PyResult<BuiltColumns<'py>> {
    let spec: BatchSpec = from_json(
        &spec_json,
        "spec",
        "build the spec with depthgate.layout.layouts (pydantic), not by hand",
    )?;
    let (flat, offsets, texts, meta) = detached(py, || {
        let mut layouts = depthgate_core::build_layouts(&tokenizer.inner, &spec)?;
        let total: usize = layouts.iter().map(|l| l.token_ids.len()).sum();
        let mut flat = Vec::with_capacity(total);
        let mut offsets = Vec::with_capacity(layouts.len() + 1);
        let mut texts = Vec::with_capacity(layouts.len());
        offsets.push(0u64);
        for l in &mut layouts {
            flat.append(&mut l.token_ids);
            offsets.push(flat.len() as u64);
            texts.push(std::mem::take(&mut l.text));
        }
        let meta = to_json(&layouts, "layout metadata")?;
        Ok((flat, offsets, texts, meta))
    })?;
    Ok((flat.into_pyarray(py), offsets.into_pyarray(py), texts, meta))
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
    let layouts: Vec<StoredLayout> = from_json(
        &layouts_json,
        "layouts",
        "pass rows of a layouts.parquet written by depthgate build",
    )?;
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
        to_json(&v, "violations")
    })?;
    Ok(out)
}

/// `values[lo..hi]` as usizes (negative values become `usize::MAX`: out of any range).
fn as_usize(values: &[i64]) -> impl Iterator<Item = usize> + '_ {
    values
        .iter()
        .map(|&x| usize::try_from(x).unwrap_or(usize::MAX))
}

/// Row `i`'s range `offsets[i]..offsets[i + 1]` in a flat column of `len` values.
fn row_ranges(
    offsets: &[u64],
    rows: usize,
    len: usize,
    what: &str,
) -> PyResult<Vec<(usize, usize)>> {
    if offsets.len() != rows + 1 {
        return Err(spec_error(
            what,
            format!("{} offsets for {rows} layouts", offsets.len()),
            "pass n + 1 row offsets",
        ));
    }
    let ranges: Vec<(usize, usize)> = offsets
        .windows(2)
        .map(|w| (w[0] as usize, w[1] as usize))
        .collect();
    if offsets[0] != 0 || ranges.iter().any(|&(a, b)| a > b || b > len) {
        return Err(spec_error(
            what,
            "row offsets are not increasing within the flat column",
            "pass the cumulative lengths of the rows, starting at 0",
        ));
    }
    Ok(ranges)
}

/// Pre-send checks for a batch of layouts bound for one system, on column buffers: one call per
/// batch, the GIL released, rows checked in parallel. Row `i` has the prompt `texts[i]`, the ids
/// `ids_flat[id_offsets[i]..id_offsets[i + 1]]`, its `target_tokens[i]`, the template digest and
/// pinned date it was rendered with, and the spans `span_offsets[i]..span_offsets[i + 1]` of the
/// flat span columns. `contract_json` is the system's [`SendContract`] (its `target_tokens` is
/// ignored). Returns each row's violations as (code, detail) pairs.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn presend_check_batch(
    py: Python<'_>,
    texts: Vec<PyBackedStr>,
    ids_flat: PyReadonlyArray1<'_, u32>,
    id_offsets: PyReadonlyArray1<'_, u64>,
    target_tokens: PyReadonlyArray1<'_, i64>,
    template_digests: Vec<PyBackedStr>,
    pinned_dates: Vec<Option<PyBackedStr>>,
    span_offsets: PyReadonlyArray1<'_, u64>,
    span_ids: Vec<PyBackedStr>,
    span_kinds: Vec<PyBackedStr>,
    span_tokens: (PyReadonlyArray1<'_, i64>, PyReadonlyArray1<'_, i64>),
    span_chars: (PyReadonlyArray1<'_, i64>, PyReadonlyArray1<'_, i64>),
    span_sha256: Vec<PyBackedStr>,
    contract_json: String,
) -> PyResult<Vec<Vec<(String, String)>>> {
    let contract: SendContract = from_json(
        &contract_json,
        "contract",
        "pass target_tokens, window, max_output_tokens, template_digest, pinned_date, bos_id",
    )?;
    let n = texts.len();
    let ids = ids_flat.as_slice()?;
    let targets = target_tokens.as_slice()?;
    if targets.len() != n || template_digests.len() != n || pinned_dates.len() != n {
        return Err(spec_error(
            "layouts",
            "the layout columns differ in length",
            "pass one value per layout in every column",
        ));
    }
    let id_rows = row_ranges(id_offsets.as_slice()?, n, ids.len(), "id_offsets")?;
    let columns = [
        span_tokens.0.as_slice()?,
        span_tokens.1.as_slice()?,
        span_chars.0.as_slice()?,
        span_chars.1.as_slice()?,
    ];
    let m = span_ids.len();
    if span_kinds.len() != m || span_sha256.len() != m || columns.iter().any(|c| c.len() != m) {
        return Err(spec_error(
            "evidence_spans",
            "the span columns differ in length",
            "pass one value per span in every span column",
        ));
    }
    let span_rows = row_ranges(span_offsets.as_slice()?, n, m, "span_offsets")?;
    let [ts, te, cs, ce] = columns.map(|c| as_usize(c).collect::<Vec<_>>());
    let mut spans = Vec::with_capacity(m);
    for i in 0..m {
        let kind = match &*span_kinds[i] {
            "evidence" => UnitKind::Evidence,
            "distractor" => UnitKind::Distractor,
            "filler" => UnitKind::Filler,
            "frame" => UnitKind::Frame,
            "request" => UnitKind::Request,
            other => {
                return Err(spec_error(
                    "evidence_spans",
                    format!("unknown span kind {other:?}"),
                    "pass the spans recorded by depthgate build",
                ))
            }
        };
        spans.push(Span {
            unit_id: span_ids[i].to_string(),
            kind,
            token_start: ts[i],
            token_end: te[i],
            char_start: cs[i],
            char_end: ce[i],
            sha256: span_sha256[i].to_string(),
        });
    }
    let out = py.detach(|| {
        let rows: Vec<PresendRow<'_>> = (0..n)
            .map(|i| PresendRow {
                text: &texts[i],
                ids: &ids[id_rows[i].0..id_rows[i].1],
                spans: &spans[span_rows[i].0..span_rows[i].1],
                template_digest: &template_digests[i],
                pinned_date: pinned_dates[i].as_deref().unwrap_or(""),
                target_tokens: usize::try_from(targets[i]).unwrap_or(usize::MAX),
            })
            .collect();
        depthgate_core::presend_check_batch(&rows, &contract)
    });
    Ok(out
        .into_iter()
        .map(|v| v.into_iter().map(|x| (x.code, x.detail)).collect())
        .collect())
}

#[pymodule(gil_used = false)]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyTokenizer>()?;
    m.add_function(wrap_pyfunction!(verify_layouts, m)?)?;
    m.add_function(wrap_pyfunction!(presend_check_batch, m)?)?;
    m.add_function(wrap_pyfunction!(build_layout_columns, m)?)?;
    m.add("ASSEMBLER_VERSION", depthgate_core::ASSEMBLER_VERSION)?;
    Ok(())
}
