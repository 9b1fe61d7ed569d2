// Which broker of the stack's cluster holds a role, for the fault commands
// and the tests that kill the one that matters:
//   java -cp 'libs/*' ClusterRoles.java BOOTSTRAP controller
//       the node id of the active controller (the KRaft quorum's leader)
//   java -cp 'libs/*' ClusterRoles.java BOOTSTRAP coordinator TRANSACTIONAL_ID
//       the node id of that transactional id's transaction coordinator
//   java -cp 'libs/*' ClusterRoles.java BOOTSTRAP leader TOPIC PARTITION
//       the node id of the partition's leader
//   java -cp 'libs/*' ClusterRoles.java BOOTSTRAP under-replicated
//       how many partitions (internal topics too) have fewer in-sync
//       replicas than replicas, or no leader
// Prints one number. Exits 1 when the cluster does not answer in 20 s.
import java.util.List;
import java.util.Map;
import java.util.concurrent.TimeUnit;
import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.ListTopicsOptions;
import org.apache.kafka.clients.admin.TopicDescription;
import org.apache.kafka.common.TopicPartitionInfo;

public class ClusterRoles {
    public static void main(String[] args) throws Exception {
        Map<String, Object> settings = Map.of(
            "bootstrap.servers", args[0],
            "request.timeout.ms", 10000,
            "default.api.timeout.ms", 20000);
        try (Admin admin = Admin.create(settings)) {
            System.out.println(switch (args[1]) {
                case "controller" -> admin.describeMetadataQuorum().quorumInfo()
                    .get(20, TimeUnit.SECONDS).leaderId();
                case "coordinator" -> admin.describeTransactions(List.of(args[2]))
                    .description(args[2]).get(20, TimeUnit.SECONDS).coordinatorId();
                case "leader" -> {
                    TopicDescription topic = admin.describeTopics(List.of(args[2]))
                        .allTopicNames().get(20, TimeUnit.SECONDS).get(args[2]);
                    TopicPartitionInfo partition = topic.partitions().get(Integer.parseInt(args[3]));
                    yield partition.leader() == null ? -1 : partition.leader().id();
                }
                case "under-replicated" -> {
                    var names = admin.listTopics(new ListTopicsOptions().listInternal(true))
                        .names().get(20, TimeUnit.SECONDS);
                    yield admin.describeTopics(names).allTopicNames().get(20, TimeUnit.SECONDS)
                        .values().stream()
                        .flatMap(t -> t.partitions().stream())
                        .filter(p -> p.leader() == null || p.isr().size() < p.replicas().size())
                        .count();
                }
                default -> throw new IllegalArgumentException("unknown role " + args[1]);
            });
        }
    }
}
