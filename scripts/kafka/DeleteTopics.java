// Deletes the topics that tests, benchmarks and the fault campaign left on
// the stack's broker: every topic but Kafka's internal ones and those whose
// name starts with one of the prefixes given after the bootstrap address.
// Run by `scripts/stack clean` with the broker's own jars on the class path
// (java's source-file mode, no build step):
//   java -cp 'libs/*' DeleteTopics.java 127.0.0.1:59092 demo-
import java.util.List;
import java.util.Map;
import org.apache.kafka.clients.admin.Admin;

public class DeleteTopics {
    public static void main(String[] args) throws Exception {
        List<String> keep = List.of(args).subList(1, args.length);
        try (Admin admin = Admin.create(Map.of("bootstrap.servers", args[0]))) {
            List<String> doomed = admin.listTopics().names().get().stream()
                .filter(name -> keep.stream().noneMatch(name::startsWith))
                .toList();
            if (!doomed.isEmpty()) {
                admin.deleteTopics(doomed).all().get();
            }
            System.out.println(doomed.size());
        }
    }
}
