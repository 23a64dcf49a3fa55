//! Runs the user's program under `Learner`, recording every numeric training metric.

use burn::module::AutodiffModule;

use super::*;

/// Keeps every numeric training metric's values, by name, in order.
#[derive(Clone, Default)]
pub struct Recorder {
    names: Arc<Mutex<HashMap<MetricId, String>>>,
    values: Arc<Mutex<HashMap<String, Vec<f64>>>>,
}

impl Recorder {
    pub fn series(&self, name: &str) -> Vec<f64> {
        self.values
            .lock()
            .unwrap()
            .get(name)
            .cloned()
            .unwrap_or_default()
    }
}

impl Recorder {
    /// Keeps a numeric metric's value under its name, after `prefix`.
    fn keep(&self, state: MetricState, prefix: &str) {
        if let MetricState::Numeric(entry, value) = state {
            let name = self.names.lock().unwrap().get(&entry.metric_id).cloned();
            let value = match value {
                NumericEntry::Value(v) => v,
                NumericEntry::Aggregated {
                    aggregated_value, ..
                } => aggregated_value,
            };
            let name = format!("{prefix}{}", name.unwrap_or_default());
            self.values
                .lock()
                .unwrap()
                .entry(name)
                .or_default()
                .push(value);
        }
    }
}

impl MetricsRendererTraining for Recorder {
    fn update_train(&mut self, state: MetricState) {
        self.keep(state, "")
    }

    /// Kept as `valid <name>`.
    fn update_valid(&mut self, state: MetricState) {
        self.keep(state, "valid ")
    }

    fn render_train(&mut self, _item: TrainingProgress, _: Vec<ProgressType>) {}

    fn render_valid(&mut self, _item: TrainingProgress, _: Vec<ProgressType>) {}
}

impl MetricsRendererEvaluation for Recorder {
    fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}

    fn render_test(&mut self, _item: EvaluationProgress, _: Vec<ProgressType>) {}
}

impl MetricsRenderer for Recorder {
    fn manual_close(&mut self) {}

    fn register_metric(&mut self, definition: MetricDefinition) {
        self.names
            .lock()
            .unwrap()
            .insert(definition.metric_id, definition.name);
    }
}

/// How one `Learner` run is set up.
pub struct Run<'a, B: AutodiffBackend> {
    pub name: &'a str,
    pub device: B::Device,
    pub epochs: usize,
    pub poison: &'a [usize],
    pub strategy: Option<ExecutionStrategy<B>>,
    /// Save a checkpoint each epoch / resume from this epoch's.
    pub checkpoint: bool,
    pub resume: Option<usize>,
    pub monitor: Option<ScalerMonitor>,
    /// Store the trainable weights in this dtype (`MemorySaving::prepare`).
    pub weights: Option<burn::tensor::FloatDType>,
}

impl<'a, B: AutodiffBackend> Run<'a, B> {
    pub fn new(name: &'a str, device: B::Device) -> Self {
        Self {
            name,
            device,
            epochs: 2,
            poison: &[],
            strategy: None,
            checkpoint: false,
            resume: None,
            monitor: None,
            weights: None,
        }
    }
}

/// What a run left: the metric series, the trained model's parameters, the training thread's
/// host reads.
pub struct Outcome {
    pub metrics: Recorder,
    pub params: Vec<f32>,
    pub param_dtypes: Vec<DType>,
    pub host_reads: u64,
}

pub fn artifacts(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-amp-learner-{}-{name}", std::process::id()));
    if !KEEP.with(|k| k.get()) {
        let _ = std::fs::remove_dir_all(&dir);
    }
    dir
}

pub fn fit<B, O>(run: Run<B>, optim: O) -> Outcome
where
    B: AutodiffBackend,
    O: Optimizer<Classifier<B>, B> + 'static,
{
    fit_as(run, optim, |model| model)
}

/// [`fit`] of the model `wrap` makes of the user's (the same inference model).
pub fn fit_as<B, W, O>(run: Run<B>, optim: O, wrap: impl FnOnce(Classifier<B>) -> W) -> Outcome
where
    B: AutodiffBackend,
    W: AutodiffModule<B, InnerModule = Classifier<B::InnerBackend>>
        + TrainStep<Input = BlobBatch<B>, Output = ClassificationOutput<B>>
        + core::fmt::Display
        + 'static,
    O: Optimizer<W, B> + 'static,
{
    B::seed(&run.device, 5);
    let model = Classifier {
        mlp: Mlp::new(D_IN, 32, CLASSES, &run.device),
    };
    let model = match run.weights {
        Some(dtype) => burn_amp::MemorySaving::new()
            .with_weights(dtype)
            .prepare(model),
        None => model,
    };
    let train = DataLoaderBuilder::<B, _, _>::new(BlobBatcher)
        .batch_size(BATCH)
        .build(Blobs::new(SAMPLES, 1, run.poison));
    let valid = DataLoaderBuilder::<B::InnerBackend, _, _>::new(BlobBatcher)
        .batch_size(128)
        .build(Blobs::new(128, 2, &[]));
    let recorder = Recorder::default();
    let dir = artifacts(run.name);
    let mut training = SupervisedTraining::new(&dir, train, valid)
        .metric_train_numeric(LossMetric::new())
        .metric_valid_numeric(LossMetric::new())
        .num_epochs(run.epochs)
        .renderer(recorder.clone());
    if let Some(monitor) = &run.monitor {
        training = training
            .metric_train_numeric(LossScaleMetric::new(monitor))
            .metric_train_numeric(SkippedStepsMetric::new(monitor))
            .metric_train_numeric(GradNormMetric::new(monitor))
            .metric_train_numeric(StepMemoryMetric::new(monitor))
            .metric_train_numeric(ActivationMemoryMetric::new(monitor));
    }
    if let Some(strategy) = run.strategy {
        training = training.with_training_strategy(strategy.into());
    }
    if run.checkpoint {
        training =
            training.with_file_checkpointer(NamedMpkFileRecorder::<FullPrecisionSettings>::new());
    }
    if let Some(epoch) = run.resume {
        training = training.checkpoint(epoch);
    }
    let before = host_reads();
    let result = training.launch(Learner::new(wrap(model), optim, 1e-2));
    let host_reads = host_reads() - before;
    let params = common::models::params(&result.model);
    let param_dtypes = [&result.model.mlp.l1.weight, &result.model.mlp.l2.weight]
        .map(|p| p.val().dtype())
        .to_vec();
    Outcome {
        metrics: recorder,
        params,
        param_dtypes,
        host_reads,
    }
}

pub fn adam<B: AutodiffBackend>()
-> impl Optimizer<Classifier<B>, B> + ScaledStep<Classifier<B>, B> + 'static
where
    B::InnerBackend: burn_amp::scaler::ScalerKernels,
{
    AdamConfig::new().init::<B, Classifier<B>>()
}

pub fn wrapped<B, O>(optim: O) -> AmpOptimizer<O, B>
where
    B: AutodiffBackend,
    B::InnerBackend: burn_amp::scaler::ScalerKernels,
    O: Optimizer<Classifier<B>, B>,
{
    AmpOptimizer::new(optim, GradScalerConfig::new()).expect("one installation")
}

pub fn mean_tail(series: &[f64], n: usize) -> f64 {
    let tail = &series[series.len().saturating_sub(n)..];
    tail.iter().sum::<f64>() / tail.len() as f64
}

/// [`fit`] without clearing the artifacts (a resumed run reads them).
pub fn fit_keep<B, O>(run: Run<B>, optim: O) -> Outcome
where
    B: AutodiffBackend,
    O: Optimizer<Classifier<B>, B> + 'static,
{
    KEEP.with(|k| k.set(true));
    let outcome = fit(run, optim);
    KEEP.with(|k| k.set(false));
    outcome
}

thread_local! {
    static KEEP: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}
