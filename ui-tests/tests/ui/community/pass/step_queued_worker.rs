// Proves: the seed's community flow compiles, and `StepQueued::<Community>::worker(Step::Classify)` is accepted.
use pgflow_runtime::{flow, Flow, FlowStep, StepQueued};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Thread {
    pub id: i64,
    pub text: String,
}

#[derive(Serialize, Deserialize)]
pub struct Classification {
    pub route: String,
}

#[flow(slug = "communityThreadsV1", input = Thread)]
pub mod community {
    use super::*;
    use pgflow_runtime::{StepContext, StepError};

    #[step]
    async fn classify(thread: Thread) -> Result<Classification, StepError> {
        Ok(Classification { route: if thread.text.is_empty() { "skip".into() } else { "help".into() } })
    }

    #[step(depends_on = [classify], slug = "deliverSlack", if = { classify: { route: "help" } })]
    async fn deliver_slack(classify: Classification, ctx: &StepContext<Community>) -> Result<(), StepError> {
        let _ = (classify.route, ctx.attempt());
        Ok(())
    }
}

use community::{Community, Step};

fn main() {
    let spec = StepQueued::<Community>::worker(Step::Classify);
    assert_eq!(spec.queue(), "communitythreadsv1__classify");
    assert_eq!(spec.step(), Step::Classify);
    assert_eq!(StepQueued::<Community>::queue_for(Step::DeliverSlack), "communitythreadsv1__deliverslack");
    assert_eq!(Community::SLUG, "communityThreadsV1");
    assert_eq!(Step::ALL, &[Step::Classify, Step::DeliverSlack]);
    assert_eq!(Step::DeliverSlack.slug(), "deliverSlack");
    assert_eq!(<Step as FlowStep>::index(Step::DeliverSlack), 1);
    assert_eq!("deliverSlack".parse::<Step>().unwrap(), Step::DeliverSlack);
    assert_eq!(Step::Classify.to_string(), "classify");
    let _ = Community::shape();
}
