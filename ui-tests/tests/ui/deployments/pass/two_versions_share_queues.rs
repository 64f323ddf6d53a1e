// Proves: two deployments of two flow versions share queues; `ALIAS`, the `Routing::Named` route map and `RoutesTo` are what the route maps say; a plain flow and `StepQueued<F>` are deployments too.
use pgflow_runtime::{deployment, flow, queue, Deployment, Queue, RoutesTo, Routing, StepQueued};

#[flow(slug = "communityThreadsV1", input = String)]
pub mod community_v1 {
    use pgflow_runtime::StepError;

    #[step]
    async fn classify(thread: String) -> Result<String, StepError> {
        Ok(thread)
    }

    #[step(depends_on = [classify], slug = "deliverSlack")]
    async fn deliver_slack(classify: String) -> Result<(), StepError> {
        let _ = classify;
        Ok(())
    }
}

#[flow(slug = "communityThreadsV2", input = String, step_queues)]
pub mod community_v2 {
    use pgflow_runtime::StepError;

    #[step]
    async fn classify(thread: String) -> Result<String, StepError> {
        Ok(thread)
    }

    #[step(depends_on = [classify])]
    async fn summarize(classify: String) -> Result<String, StepError> {
        Ok(classify)
    }

    #[step(depends_on = [summarize], slug = "deliverSlack")]
    async fn deliver_slack(summarize: String) -> Result<(), StepError> {
        let _ = summarize;
        Ok(())
    }
}

/// Classification work of every version.
#[queue("classify_threads")]
pub struct ClassifyThreads;

/// Slack deliveries of every version.
#[queue("deliver_slack_alerts")]
pub struct DeliverSlackAlerts;

/// Summaries, new in version 2.
#[queue("summarize_threads")]
pub struct SummarizeThreads;

/// Version 1 of the community pipeline.
#[deployment(alias = "communityThreads", name = CommunityV1Deployment)]
pub fn community_v1(step: community_v1::Step) {
    match step {
        community_v1::Step::Classify => ClassifyThreads,
        community_v1::Step::DeliverSlack => DeliverSlackAlerts,
    }
}

/// Version 2: one more step, the same alias and the same shared queues.
#[deployment(alias = "communityThreads", name = CommunityV2Deployment)]
pub fn community_v2(step: community_v2::Step) {
    use community_v2::Step;
    match step {
        Step::Classify => ClassifyThreads,
        Step::Summarize => SummarizeThreads,
        Step::DeliverSlack => DeliverSlackAlerts,
    }
}

/// What a queue worker for `Q` requires of a deployment.
fn serves<Q: Queue, D: RoutesTo<Q>>() -> (&'static str, Option<&'static str>) {
    (Q::NAME, D::ALIAS)
}

fn named<D: Deployment>() -> fn(<D::Flow as pgflow_runtime::Flow>::Step) -> &'static str {
    match D::routing() {
        Routing::Named(route) => route,
        _ => panic!("not a named deployment"),
    }
}

fn main() {
    assert_eq!(<CommunityV1Deployment as Deployment>::ALIAS, Some("communityThreads"));
    assert_eq!(CommunityV2Deployment::ALIAS, Some("communityThreads"));

    let v1 = named::<CommunityV1Deployment>();
    assert_eq!(v1(community_v1::Step::Classify), ClassifyThreads::NAME);
    assert_eq!(v1(community_v1::Step::DeliverSlack), DeliverSlackAlerts::NAME);
    let v2 = named::<CommunityV2Deployment>();
    assert_eq!(v2(community_v2::Step::Classify), "classify_threads");
    assert_eq!(v2(community_v2::Step::Summarize), "summarize_threads");
    assert_eq!(v2(community_v2::Step::DeliverSlack), "deliver_slack_alerts");

    // One worker per shared queue serves both versions.
    assert_eq!(serves::<ClassifyThreads, CommunityV1Deployment>().0, "classify_threads");
    assert_eq!(serves::<ClassifyThreads, CommunityV2Deployment>().0, "classify_threads");
    assert_eq!(serves::<DeliverSlackAlerts, CommunityV1Deployment>().0, "deliver_slack_alerts");
    assert_eq!(serves::<SummarizeThreads, CommunityV2Deployment>().1, Some("communityThreads"));

    // A plain flow is its own default deployment; `StepQueued<F>` deploys per-step queues.
    assert_eq!(<community_v1::CommunityV1 as Deployment>::ALIAS, None);
    assert!(matches!(
        <community_v1::CommunityV1 as Deployment>::routing(),
        Routing::FlowQueue
    ));
    assert_eq!(<StepQueued<community_v2::CommunityV2> as Deployment>::ALIAS, None);
    match <StepQueued<community_v2::CommunityV2> as Deployment>::routing() {
        Routing::StepQueues(routes) => assert_eq!(routes[1].1, "communitythreadsv2__summarize"),
        _ => panic!("not per-step queues"),
    }
}
