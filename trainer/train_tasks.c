/* train_tasks.c - what train.loss and data.target add to a run: the
 * anomaly classes held out of training, the fit of the model's output to
 * an mse target, the test split's AUC, and how mse results are reported.
 * The loss itself and the evaluation sums are train.c's (run_loss,
 * run_evaluate). */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "data/dataset.h"
#include "trainer/metrics.h"
#include "trainer/run.h"

/* data.anomaly_classes: training never sees them (dropped from train and
 * val); the test split keeps them as the AUC's positives, so it must hold
 * both kinds. */
QtStatus run_drop_anomalies(Run *r, QtError *err) {
    const DataConfig *dc = &r->cfg->data;
    if (dc->n_anomaly_classes == 0) return QT_OK;
    char list[DATASET_MAX_CLASSES * 5] = "";
    for (int i = 0; i < dc->n_anomaly_classes; i++)
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%d", i ? ", " : "", dc->anomaly_classes[i]);
    int dropped = 0, test_anomalies = 0;
    for (int i = 0; i < dc->n_anomaly_classes; i++)
        if (dc->anomaly_classes[i] >= r->data.train.n_classes)
            return qt_error_set(err, QT_ERR_CONFIG, "%s: data.anomaly_classes [%s] names class %d, but the data has "
                                "%d classes (labels 0..%d); list classes the data has", r->cfg->source, list,
                                dc->anomaly_classes[i], r->data.train.n_classes, r->data.train.n_classes - 1);
    QtError e = {0};
    QtStatus st = dataset_drop_classes(&r->data.train, dc->anomaly_classes, dc->n_anomaly_classes, &dropped, &e);
    if (st == QT_OK) st = dataset_drop_classes(&r->data.val, dc->anomaly_classes, dc->n_anomaly_classes, NULL, &e);
    if (st != QT_OK) return qt_error_set(err, st, "%s: data.anomaly_classes [%s]: %s", r->cfg->source, list, e.msg);
    for (int i = 0; r->data.test.labels && i < r->data.test.n; i++)
        for (int k = 0; k < dc->n_anomaly_classes; k++)
            test_anomalies += r->data.test.labels[i] == dc->anomaly_classes[k];
    if (r->data.train.n == 0)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: data.anomaly_classes [%s] leaves no training example (all %d "
                            "are of these classes); list only the classes to hold out", r->cfg->source, list, dropped);
    if (test_anomalies == 0 || test_anomalies == r->data.test.n)
        return qt_error_set(err, QT_ERR_CONFIG, "%s: data.anomaly_classes [%s]: the test split's %d examples are %s "
                            "of these classes, so the AUC is undefined; it needs both normal and anomalous examples",
                            r->cfg->source, list, r->data.test.n, test_anomalies ? "all" : "none");
    return QT_OK;
}

/* train.loss: mse compares the model's output with the input itself
 * (data.target: input) or the data set's value targets: the output must
 * have that many values per example. */
QtStatus run_check_mse_fits(Run *r, const Module *last, QtError *err) {
    const Dataset *d = &r->data.train;
    bool input = r->cfg->data.target == DATA_TARGET_INPUT;
    if (!input && !d->targets)
        return qt_error_set(err, QT_ERR_CONFIG,
                            "%s: train.loss: mse needs value targets, but the %s data set has class labels; set "
                            "data.target: input to train an autoencoder, or train.loss: cross_entropy to classify",
                            r->cfg->source, r->cfg->data.dataset);
    int want = input ? d->feat : d->n_targets, got = 1;
    for (int i = 0; i < last->out_ndim; i++) got *= last->out_shape[i];
    if (got != want)
        return qt_error_set(err, QT_ERR_CONFIG,
                            "%s: the last layer (%s) gives %d values per example, but %s %d values per example; make "
                            "the last layer give %d values (a dense layer's units)",
                            r->cfg->source, last->path, got,
                            input ? "with data.target: input the model must reconstruct the input's"
                                  : "train.loss: mse compares them with the data set's targets,", want, want);
    return QT_OK;
}

/* The test split's ROC AUC from its reconstruction errors, anomalies
 * (data.anomaly_classes) the positives. */
double run_test_auc(Run *r) {
    const Dataset *d = &r->data.test;
    const DataConfig *dc = &r->cfg->data;
    if (!r->work.auc || !d->labels) return NAN;
    for (int i = 0; i < d->n; i++) {
        bool anomaly = false;
        for (int k = 0; k < dc->n_anomaly_classes; k++) anomaly |= d->labels[i] == dc->anomaly_classes[k];
        r->work.auc[i] = (AucItem){.score = r->work.scores[i], .positive = anomaly};
    }
    return metrics_roc_auc(r->work.auc, d->n);
}

/* The numbers after "loss:" in an eval line: acc, or mae (and the AUC). */
void run_eval_tail(const Run *r, double acc, double mae, bool test, char *buf, size_t cap) {
    if (r->cfg->train.loss == LOSS_CROSS_ENTROPY) {
        snprintf(buf, cap, "acc:%.4f", acc);
        return;
    }
    int k = snprintf(buf, cap, "mae:%.4f", mae);
    if (test && r->cfg->data.n_anomaly_classes > 0 && k > 0 && (size_t)k < cap)
        snprintf(buf + k, cap - (size_t)k, " auc:%.4f", r->eval.test_auc);
}

void run_fill_eval_result(const Run *r, TrainResult *res) {
    res->mse = r->cfg->train.loss == LOSS_MSE;
    res->test_mse = res->mse ? res->test_loss : NAN;
    res->test_mae = res->mse ? r->eval.test_mae : NAN;
    res->val_mse = !res->mse ? NAN : res->val_loss >= 0 ? res->val_loss : -1.0;
    res->val_mae = !res->mse ? NAN : res->val_loss >= 0 ? r->eval.val_mae : -1.0;
    res->test_auc = r->cfg->data.n_anomaly_classes > 0 ? r->eval.test_auc : NAN;
}

void train_result_format(const TrainResult *res, char *buf, size_t cap) {
    if (!res->mse) {
        snprintf(buf, cap, "test_accuracy:%.4f test_loss:%.4f", res->test_accuracy, res->test_loss);
        return;
    }
    int k = snprintf(buf, cap, "test_mse:%.4f test_mae:%.4f", res->test_mse, res->test_mae);
    if (!isnan(res->test_auc) && k > 0 && (size_t)k < cap) snprintf(buf + k, cap - (size_t)k, " test_auc:%.4f",
                                                                     res->test_auc);
}
