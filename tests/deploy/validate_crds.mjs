// Validate prometheus-operator custom resources with @kubernetes-models/prometheus-operator (its
// JSON schemas come from the operator's CRDs). Reads a JSON array of objects on stdin; prints one
// line per object and exits 1 if any is invalid or of a kind this script does not know.
import { PodMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PodMonitor";
import { PrometheusRule } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PrometheusRule";
import { ServiceMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor";

const MODELS = { PodMonitor, PrometheusRule, ServiceMonitor };
let input = "";
for await (const chunk of process.stdin) input += chunk;
let failed = false;
for (const doc of JSON.parse(input)) {
  const Model = MODELS[doc.kind];
  const name = `${doc.kind}/${doc.metadata?.name}`;
  if (!Model) {
    console.log(`UNKNOWN ${name}`);
    failed = true;
    continue;
  }
  try {
    new Model(doc).validate();
    console.log(`OK ${name}`);
  } catch (err) {
    console.log(`INVALID ${name}: ${err.message}`);
    failed = true;
  }
}
process.exit(failed ? 1 : 0);
