"""Quality metrics for generated images.

* 28x28 grayscale (Fashion-MNIST): class-conditional accuracy and the Fréchet distance of the project's
  classifier features (``data/fashion_classifier.pt``, ``data/fashion_test_stats.npz``), read against a
  real-vs-real floor.
* RGB (ImageNet): FID and Inception Score with the FID InceptionV3 loaded from a local weights file.

``quality_report(samples)`` picks the metrics by image shape; ``format_report`` prints them. The classifier is
trained by ``python -m mar_probe.quality.train_classifier`` (function:
:func:`mar_probe.quality.classifier.train_classifier`).
"""
from .classifier import (DEFAULT_CLASSIFIER_PATH, ClassifierConfig, ClassifierFileError, FashionCNN,
                         TrainClassifierConfig, classifier_outputs, load_classifier, predict, save_classifier)
from .fashion import (DEFAULT_REFERENCE_PATH, class_accuracy, compute_reference_stats, fashion_frechet,
                      fashion_report, load_reference_stats, per_class_accuracy, save_reference_stats)
from .frechet import feature_stats, frechet_distance
from .inception import (FIDInceptionV3, InceptionFileError, fid_from_features, fid_from_images,
                        inception_features_and_logits, inception_score, load_inception, load_inception_reference)
from .paired import STATISTICS, Interval, interval
from .report import format_report, load_samples, quality_report

__all__ = [
    "DEFAULT_CLASSIFIER_PATH", "DEFAULT_REFERENCE_PATH", "STATISTICS", "ClassifierConfig", "ClassifierFileError",
    "FashionCNN", "FIDInceptionV3", "InceptionFileError", "Interval", "TrainClassifierConfig", "class_accuracy",
    "classifier_outputs", "compute_reference_stats", "fashion_frechet", "fashion_report", "feature_stats",
    "fid_from_features", "fid_from_images", "format_report", "frechet_distance", "inception_features_and_logits",
    "inception_score", "interval", "load_classifier", "load_inception", "load_inception_reference",
    "load_reference_stats", "load_samples", "per_class_accuracy", "predict", "quality_report", "save_classifier",
    "save_reference_stats",
]
